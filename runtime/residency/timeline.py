"""A timeline of copies vs compute, exportable as a Chrome / Perfetto trace (JSON)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    name: str
    kind: str  # "copy", "compute", "stall" or "host" (host compute of misses)
    start: float
    end: float
    thread: int
    args: tuple[tuple[str, object], ...] = ()


class Timeline:
    """Records spans while `enabled`; `export` writes the Chrome trace event format."""

    def __init__(self, enabled: bool = False, process: int = 0) -> None:
        """`process`: the `jax.distributed` process index, the trace's pid (several
        processes' files open side by side in Perfetto)."""
        self.enabled = enabled
        self.process = process
        self.spans: list[Span] = []
        self.lanes: dict[str, int] = {}  # named rows of the trace (`add(lane=...)`): tid
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def span(self, name: str, kind: str, **args: object) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            s = Span(name, kind, start, time.perf_counter(), threading.get_ident(),
                     tuple(args.items()))
            with self._lock:
                self.spans.append(s)

    def clear(self) -> None:
        with self._lock:
            self.spans = []

    def add(self, name: str, kind: str, start: float, end: float, lane: str | None = None,
            **args: object) -> None:
        """Record a span measured elsewhere (perf_counter times), on the calling thread's row
        or on the named `lane`'s."""
        if not self.enabled:
            return
        with self._lock:
            thread = (threading.get_ident() if lane is None
                      else self.lanes.setdefault(lane, -len(self.lanes) - 1))
            self.spans.append(Span(name, kind, start, end, thread, tuple(args.items())))

    def total(self, kind: str) -> float:
        return sum(s.end - s.start for s in self.spans if s.kind == kind)

    def overlap_fraction(self) -> float:
        """Share of copy time that ran while a compute span was open (0 if no copies)."""
        copies = [s for s in self.spans if s.kind == "copy"]
        computes = sorted((s.start, s.end) for s in self.spans if s.kind == "compute")
        total = sum(c.end - c.start for c in copies)
        if total == 0:
            return 0.0
        covered = 0.0
        for c in copies:
            for a, b in computes:
                covered += max(0.0, min(b, c.end) - max(a, c.start))
        return min(1.0, covered / total)

    def busy(self, kind: str) -> float:
        """Seconds during which at least one span of `kind` was open (their union)."""
        spans = sorted((s.start, s.end) for s in self.spans if s.kind == kind)
        busy, reach = 0.0, float("-inf")
        for a, b in spans:
            if b > reach:
                busy += b - max(a, reach)
                reach = b
        return busy

    def export(self, path: str | os.PathLike) -> None:
        """Write the spans as Chrome trace events (open in chrome://tracing or Perfetto)."""
        events: list[dict[str, object]] = [
            {"name": "process_name", "ph": "M", "pid": self.process,
             "args": {"name": f"strata process {self.process}"}}]
        events += [{"name": "thread_name", "ph": "M", "pid": self.process, "tid": tid,
                    "args": {"name": lane}} for lane, tid in self.lanes.items()]
        events += [
            {"name": s.name, "cat": s.kind, "ph": "X", "pid": self.process, "tid": s.thread,
             "ts": (s.start - self._t0) * 1e6, "dur": (s.end - s.start) * 1e6,
             "args": {k: str(v) for k, v in s.args}}
            for s in self.spans
        ]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
