"""Experts computed on the host cores, where tier 1 holds their weights.

docs/design.md, "Host compute of misses". The step hands a layer's host share to this module
through two callbacks (`misses.host_round_trip`): `submit` starts the work on a worker thread
and returns at once, so the device goes on copying and computing the other misses; `collect`
waits for it and returns each pick's output. The kernel reads the tier-1 `pinned_host`
buffers in place (no copy of the weights): a `HostTier` holds numpy views of them, registered
under an integer id that the step carries as an argument, so one compiled program serves every
engine and every version of the tier.

The experts are computed by the compiled kernel of `host_kernel` (float and packed int4) on all
cores but one: the core left over keeps the device fed while the host computes. Host compute
rounds differently from the device's kernels (docs/design.md: a tested tolerance, not bits).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from strata_jax.ops import host_kernel
from strata_jax.ops.pool import ExpertPool, host_view

KINDS = ("w1", "w3", "w2")
SCALES = ("w1_scale", "w3_scale", "w2_scale")
FLOAT_DTYPES = frozenset({"bfloat16", "float32", "float16"})


def check_pool(pool: ExpertPool) -> None:
    """Refuse a tier-1 pool the host kernel cannot read."""
    if pool.quantized:
        if any(np.dtype(getattr(pool, k).dtype) != np.uint8 for k in KINDS) or any(
                str(np.dtype(getattr(pool, s).dtype)) != "bfloat16" for s in SCALES):
            raise ValueError("host compute of packed int4 experts take uint8 weights with "
                             "bfloat16 scales, got "
                             f"{[str(getattr(pool, k).dtype) for k in (*KINDS, *SCALES)]}")
        f, d, _, tb1 = host_kernel.int4_layout(pool.w1.shape[1:])
        _, _, _, tb2 = host_kernel.int4_layout(pool.w2.shape[1:])
        group = d // pool.w1_scale.shape[1]
        if any(v % 32 for v in (d, f, group, tb1, tb2)):
            raise ValueError(f"host compute of packed int4 experts needs D={d}, F={f}, the "
                             f"group {group} and the tile's inputs to be multiples of 32: use "
                             "miss='fetch'")
        return
    name = str(np.dtype(pool.w1.dtype))
    if name not in FLOAT_DTYPES:
        raise ValueError(f"host compute takes float experts, got {name}")


@dataclass
class HostTier:
    """Views of one version of the tier-1 pool, and what the host computed with them."""

    pool: ExpertPool
    """The jax arrays the views read: kept alive while the views are in use."""
    views: dict[str, np.ndarray]
    """Each weight kind (and a packed pool's scales) as a numpy array over the pool's buffer:
    float [slots, in, out], packed as `ExpertPool` holds them."""
    busy_s: float = 0.0
    """Seconds the worker spent in the kernel."""
    experts: int = 0
    """Experts computed."""
    trips: int = 0
    """Layers whose host share was collected (`RoundTrip`s)."""
    queue_s: float = 0.0
    """Seconds from `submit` to the worker's start, summed over the round trips."""
    wait_s: float = 0.0
    """Seconds the device waited in `collect` for the host, summed."""
    early_s: float = 0.0
    """Seconds the host's outputs waited for the device to reach `collect`, summed."""
    lock: threading.Lock = field(default_factory=threading.Lock)


TOTALS = ("busy_s", "experts", "trips", "queue_s", "wait_s", "early_s")
"""The `HostTier` counters that add up over versions of the tier."""


@dataclass
class RoundTrip:
    """One layer's host share, in `time.perf_counter` seconds: the device reached `submit`,
    the worker started and ended the kernel, the device reached `collect` and `collect`
    returned the outputs. Where a B=1 layer's time goes beyond the kernel's
    (docs/design.md, "Host compute of misses")."""

    tier: int
    submitted: float
    started: float = 0.0
    ended: float = 0.0
    collected: float = 0.0
    returned: float = 0.0
    experts: int = 0
    rows: int = 0


_TIERS: dict[int, HostTier] = {}
_IDS = itertools.count(1)
_PENDING: dict[int, tuple[Future, RoundTrip]] = {}
_RECENT: deque[RoundTrip] | None = None  # the collected round trips, while recording
_TICKETS = itertools.count(1)
_WORKER: ThreadPoolExecutor | None = None
_GUARD = threading.Lock()


def set_threads(threads: int | None) -> int:
    """Cores the host kernel uses (None: all but a quarter); returns the count set."""
    return host_kernel.set_threads(threads)


def register(pool: ExpertPool) -> int:
    """Views of `pool` (a host-resident tier-1 pool) under a new id."""
    check_pool(pool)
    host_kernel.library()  # compiled now, not in the step's first callback
    tier_id = next(_IDS)
    kinds = KINDS + (SCALES if pool.quantized else ())
    _TIERS[tier_id] = HostTier(pool, {k: host_view(getattr(pool, k)) for k in kinds})
    return tier_id


def release(tier_id: int) -> None:
    _TIERS.pop(tier_id, None)


def tier(tier_id: int) -> HostTier:
    try:
        return _TIERS[tier_id]
    except KeyError:
        raise KeyError(f"host tier {tier_id} is not registered (released, or never "
                       "registered by this process)") from None


def quantized(views: dict[str, np.ndarray]) -> bool:
    return "w1_scale" in views


def hidden_size(views: dict[str, np.ndarray]) -> int:
    if quantized(views):
        return host_kernel.int4_layout(views["w1"].shape[1:])[1]
    return views["w1"].shape[1]


def swiglu(views: dict[str, np.ndarray], slot: int, x: np.ndarray) -> np.ndarray:
    """(silu(x @ w1) * (x @ w3)) @ w2 of host slot `slot` for rows x [r, D] (numpy, the
    activations' dtype) -> float32 [r, D]: the gate and up products in float32, rounded to
    x's dtype before the down projection, as the device kernels do (`host_kernel.swiglu`)."""
    if quantized(views):
        return host_kernel.swiglu_int4(*(views[n][slot] for k in KINDS
                                         for n in (k, f"{k}_scale")), x)
    return host_kernel.swiglu(*(views[k][slot] for k in KINDS), x)


def compute(tier_id: int, h: np.ndarray, experts: np.ndarray, live: np.ndarray,
            hosted: np.ndarray, host_row: np.ndarray, trip: RoundTrip | None = None
            ) -> np.ndarray:
    """Each pick's output [N, k, D] float32 for the picks of live tokens routed to the
    experts marked in `hosted` [E] (others zero): h [N, D] the layer's MoE input, experts
    [N, k] the picks, host_row [E] each expert's tier-1 slot. `trip`: timed into it."""
    t = tier(tier_id)
    n, k = experts.shape
    out = np.zeros((n, k, h.shape[-1]), np.float32)
    h = np.asarray(h)
    t0 = time.perf_counter()
    done = rows = 0
    for e in np.flatnonzero(hosted):
        picks = (experts == e) & live[:, None]
        tokens, which = np.nonzero(picks)
        if not len(tokens):
            continue
        out[tokens, which] = swiglu(t.views, int(host_row[e]), h[tokens])
        done += 1
        rows += len(tokens)
    t1 = time.perf_counter()
    with t.lock:
        t.busy_s += t1 - t0
        t.experts += done
    if trip is not None:
        trip.started, trip.ended, trip.experts, trip.rows = t0, t1, done, rows
    return out


def _worker() -> ThreadPoolExecutor:
    global _WORKER
    with _GUARD:
        if _WORKER is None:
            _WORKER = ThreadPoolExecutor(1, thread_name_prefix="strata-host")
        return _WORKER


def submit(tier_id, h, experts, live, hosted, host_row) -> np.ndarray:
    """Start `compute` on the worker thread; returns its ticket (int32 [])."""
    trip = RoundTrip(int(tier_id), time.perf_counter())
    ticket = next(_TICKETS)
    _PENDING[ticket] = (_worker().submit(compute, int(tier_id), np.asarray(h),
                                         np.asarray(experts), np.asarray(live),
                                         np.asarray(hosted), np.asarray(host_row), trip), trip)
    return np.asarray(ticket, np.int32)


def collect(ticket, _after) -> np.ndarray:
    """The outputs of the work of `ticket` (waits for it). `_after` is an operand only so
    that the step calls this after its own copies and kernels (`misses.host_round_trip`)."""
    future, trip = _PENDING.pop(int(ticket))
    trip.collected = time.perf_counter()
    out = future.result()
    trip.returned = time.perf_counter()
    t = _TIERS.get(trip.tier)
    if t is not None:
        with t.lock:
            t.trips += 1
            t.queue_s += trip.started - trip.submitted
            t.wait_s += trip.returned - trip.collected
            t.early_s += max(0.0, trip.collected - trip.ended)
    recent = _RECENT
    if recent is not None:
        recent.append(trip)
    return out


def record_round_trips(on: bool, keep: int = 1 << 16) -> None:
    """Keep the last `keep` collected `RoundTrip`s (for a timeline) while `on`."""
    global _RECENT
    _RECENT = deque(maxlen=keep) if on else None


def recent_round_trips() -> list[RoundTrip]:
    """The round trips kept since the last call (empties the record)."""
    recent = _RECENT
    if recent is None:
        return []
    out = []
    while recent:
        out.append(recent.popleft())
    return out


def measure(tier_id: int, rows: tuple[int, int] = (1, 16), repeats: int = 5
             ) -> tuple[float, float]:
    """(GB/s of expert bytes at `rows[0]` rows, the relative cost of each further row)
    (`misses.MissRates`): the median of `repeats` timed rounds after an untimed one, each
    round timing both row counts, each call on the next tier slot. Round robin over the slots
    so that no expert is read from the caches, both counts in every round so that whatever
    else runs meanwhile slows both alike."""
    t = tier(tier_id)
    d = hidden_size(t.views)
    nbytes = sum(v[0].nbytes for v in t.views.values())
    dtype = host_kernel.BF16 if quantized(t.views) else t.views["w1"].dtype
    slots = t.views["w1"].shape[0]
    xs = [np.ones((r, d), dtype=dtype) for r in rows]
    runs: list[list[float]] = [[] for _ in rows]
    for i in range(repeats + 1):
        for j, x in enumerate(xs):
            t0 = time.perf_counter()
            swiglu(t.views, (i * len(xs) + j) % slots, x)
            if i:
                runs[j].append(time.perf_counter() - t0)
    times = [float(np.median(r)) for r in runs]
    growth = max(0.0, (times[1] / times[0] - 1) / (rows[1] - rows[0]))
    return nbytes / times[0] / 1e9, growth


def measure_with_copies(tier_id: int, device, nbytes: int = 64 << 20
                        ) -> tuple[float, float, float]:
    """(link GB/s, host kernel GB/s at one row, its cost per further row) timed with both at
    work at once: `measure` runs while another thread copies a pinned buffer of `nbytes` to
    `device` over and over. The "auto" split sends a layer's misses to both at once, and they
    share the host's memory bandwidth (docs/design.md, "Host compute of misses"), so each one's
    rate alone would overrate the host's share."""
    import jax

    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    buffer = jax.device_put(np.ones(nbytes // 4, np.float32), pinned)
    jax.block_until_ready(jax.device_put(buffer, on_device))
    stop = threading.Event()
    moved = {"bytes": 0, "s": 0.0}

    def copies() -> None:
        t0 = time.perf_counter()
        while not stop.is_set():
            jax.block_until_ready(jax.device_put(buffer, on_device))
            moved["bytes"] += nbytes
        moved["s"] = time.perf_counter() - t0

    copier = threading.Thread(target=copies, name="strata-link-probe")
    copier.start()
    try:
        host_gbps, growth = measure(tier_id)
    finally:
        stop.set()
        copier.join()
    return moved["bytes"] / max(moved["s"], 1e-9) / 1e9, host_gbps, growth
