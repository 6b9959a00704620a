"""The transfer engine: moves experts from tier 1 / tier 2 to the device, ahead of compute.

A tier-1 expert already sits in pinned host memory as jax arrays, so its host->device copy is
issued at once, on the calling thread, as an asynchronous `device_put` (the copy engine runs it
while the GPU computes; DESIGN.md: a pinned copy issued before the compute it should overlap).
A tier-2 expert is read from disk, verified and (with `dequant="host"`) expanded on a fetch
thread first, which then issues its copy. Either way the caller gets a `Transfer` at once and
only waits for it where its weights are installed into a staging slot, and that install is a
device program queued behind the copy, so the host never blocks on it.

With a timeline, two watcher threads wait on copies and on compute in issue order and record
when each really finished: that gives the copy / compute spans, the overlap fraction and the
time compute waited for copies (stalls).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import jax

from strata_runtime.numa import NumaPlan, bind_current_thread
from strata_runtime.timeline import Timeline

Arrays = Mapping[str, object]


def to_device(arrays: Arrays, device: jax.Device) -> dict[str, jax.Array]:
    """Issue the host->device copies of one expert's arrays (asynchronous)."""
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    return dict(zip(arrays, jax.device_put(list(arrays.values()), sharding), strict=True))


@dataclass
class Transfer:
    """One expert on its way to the device."""

    layer: int
    expert: int
    tier: int
    issued: float
    future: Future
    done: float | None = None  # when the copy finished (timeline only)
    recorded: threading.Event = field(default_factory=threading.Event)

    def result(self) -> dict[str, jax.Array]:
        """The device arrays (a `CheckpointError` if its chunk could not be read)."""
        return self.future.result()


@dataclass
class TransferStats:
    """Copies per source tier, their bytes, and the prefetched bytes nobody used."""

    copies: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 0})
    bytes: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 0})
    wasted_copies: int = 0
    wasted_bytes: int = 0


class TransferEngine:
    """Starts expert copies to `device`; host-side work runs on NUMA-bound fetch threads."""

    def __init__(self, fetch: Callable[[int, int], tuple[int, Arrays]], device: jax.Device,
                 threads: int, numa: NumaPlan, timeline: Timeline) -> None:
        self._fetch, self.device, self.timeline = fetch, device, timeline
        self.numa = numa
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="strata-fetch",
                                        initializer=bind_current_thread, initargs=(numa,))
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._watchers: dict[str, _Watcher] = {}
        if timeline.enabled:
            self._watchers = {k: _Watcher(k, timeline) for k in ("copy", "compute")}

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The fetch threads (bound to the GPU's NUMA node): allocate pinned buffers here."""
        return self._pool

    def start(self, layer: int, expert: int, pinned: Arrays | None) -> Transfer:
        """Begin moving (layer, expert): `pinned` arrays are copied now, else fetched first."""
        now = time.perf_counter()
        if pinned is not None:
            future: Future = Future()
            future.set_result(self._issue(layer, expert, 1, pinned))
            t = Transfer(layer, expert, 1, now, future)
        else:
            future = self._pool.submit(self._fetch_and_issue, layer, expert)
            t = Transfer(layer, expert, 2, now, future)
        if "copy" in self._watchers:
            self._watchers["copy"].put(f"copy L{layer} E{expert}", t, t.future, ())
        return t

    def _fetch_and_issue(self, layer: int, expert: int) -> dict[str, jax.Array]:
        tier, arrays = self._fetch(layer, expert)
        return self._issue(layer, expert, tier, arrays)

    def _issue(self, layer: int, expert: int, tier: int, arrays: Arrays) -> dict[str, jax.Array]:
        nbytes = sum(a.nbytes for a in arrays.values())
        with self._lock:
            self.stats.copies[tier] += 1
            self.stats.bytes[tier] += nbytes
        return to_device(arrays, self.device)

    def wasted(self, t: Transfer) -> None:
        """A prefetched expert that its layer did not route to: count the bytes it cost (once
        its fetch is done, if it was still reading from disk)."""

        def count(future: Future) -> None:
            if future.exception() is None:
                nbytes = sum(a.nbytes for a in future.result().values())
                with self._lock:
                    self.stats.wasted_copies += 1
                    self.stats.wasted_bytes += nbytes

        t.future.add_done_callback(count)

    def computed(self, label: str, outputs: object, waits_for: tuple[Transfer, ...]) -> None:
        """Record a dispatched compute (timeline only): its span and the copies it waited on."""
        if "compute" in self._watchers:
            future: Future = Future()
            future.set_result(outputs)
            self._watchers["compute"].put(label, None, future, waits_for)

    def drain(self) -> None:
        """Wait until the watchers have recorded everything issued so far."""
        for w in self._watchers.values():
            w.drain()

    def close(self) -> None:
        for w in self._watchers.values():
            w.close()
        self._pool.shutdown(wait=True, cancel_futures=True)


class _Watcher:
    """Waits, in issue order, for copies (or compute) to finish and records their spans.

    A copy starts when it was issued or when the previous copy finished, whichever is later
    (the copy engine runs them in order); compute likewise on the compute stream. The wait of a
    compute for its copies (copy finished after the previous compute did) is a stall span.
    """

    def __init__(self, kind: str, timeline: Timeline) -> None:
        self.kind, self.timeline = kind, timeline
        self._queue: queue.Queue = queue.Queue()
        self._last_end = 0.0
        self._thread = threading.Thread(target=self._run, name=f"strata-watch-{kind}",
                                        daemon=True)
        self._thread.start()

    def put(self, label: str, transfer: Transfer | None, future: Future,
            waits_for: tuple[Transfer, ...]) -> None:
        self._queue.put((label, transfer, future, waits_for, time.perf_counter()))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._record(*item)
            finally:
                self._queue.task_done()

    def _record(self, label: str, transfer: Transfer | None, future: Future,
                waits_for: tuple[Transfer, ...], issued: float) -> None:
        try:
            jax.block_until_ready(future.result())
        except Exception:  # a failed fetch: its error reaches the engine, not the timeline
            pass
        end = time.perf_counter()
        start = max(issued, self._last_end)
        if transfer is not None:
            transfer.done = end
            transfer.recorded.set()
        for t in waits_for:
            t.recorded.wait()
        ready = max((t.done or 0.0 for t in waits_for), default=0.0)
        if ready > start:
            self.timeline.add(f"wait {label}", "stall", start, ready)
            start = ready
        self.timeline.add(label, self.kind, start, max(start, end))
        self._last_end = end

    def drain(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
