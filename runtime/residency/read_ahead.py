"""Tier 2 -> tier 1 ahead of need, by heat (docs/design.md, "Read-ahead").

A disk stall admits the experts it needs into tier 1 whatever their heat, in place of the
coldest tier-1 experts without a device slot, which may be hotter than what replaces them (so
may the look-ahead's loads, routed on an input the stalled layer had not finished). Between
decode steps `ReadAhead` starts reads, on a thread of its own so that no step waits for them,
of the hottest experts found only on disk whose heat exceeds the coldest such tier-1 expert's
by the hysteresis, and writes each finished one into tier 1 at a later step boundary, where no
program reads tier 1 (`Residency.admit_host`), if it is still that much hotter than what it
replaces. Tier 1 thus drifts back to the hottest experts it can hold, and the stalls that the
heat can foresee do not happen. What tier 1 holds never changes a result bit.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from strata_runtime.residency.tiers import Arrays, Key, Residency


class ReadAhead:
    """One device's reads ahead: at most `limit` in flight or waiting to be written."""

    def __init__(self, limit: int, hysteresis: float, load: Callable[[Key], Arrays | str],
                 initializer: Callable[[], None] | None = None) -> None:
        """`load(key)` reads one expert as the pools hold it, or returns why it could not
        (the expert is then left for the stall that needs it, which fails its rows);
        `initializer` runs on the reading thread first (e.g. NUMA binding)."""
        if limit < 0 or hysteresis < 0:
            raise ValueError(f"need limit >= 0 and hysteresis >= 0, got {limit}, {hysteresis}")
        self.limit, self.hysteresis, self._load = limit, hysteresis, load
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-read-ahead",
                                        initializer=initializer) if limit else None
        self._pending: dict[Key, Future] = {}
        self.unreadable: set[Key] = set()
        """Experts whose read failed: not read ahead again."""

    def between_steps(self, residency: Residency, heat: np.ndarray) -> int:
        """Write the reads that finished into `residency`'s tier 1, then start the next ones.
        Call only where no program that reads tier 1 is in flight. `heat` [L, E]: -inf for the
        experts another device owns. Returns the experts written."""
        if self._pool is None:
            return 0
        written = 0
        for key, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[key]
            arrays = future.result()
            if isinstance(arrays, str):
                self.unreadable.add(key)  # the stall that needs it fails its rows
                continue
            if residency.on_host(key) or residency.slot_of(key) is not None:
                continue  # a stall loaded it meanwhile
            victim = next(iter(self._victims(residency, heat)), None)
            if victim is not None and self._hotter(heat, key, victim):
                residency.admit_host(key, arrays, victim)
                written += 1
        for key in self._plan(residency, heat):
            self._pending[key] = self._pool.submit(self._load, key)
        return written

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pending.clear()

    def _plan(self, residency: Residency, heat: np.ndarray) -> list[Key]:
        """Experts to read now: the hottest found only on disk (no device slot either), each
        hotter than the victim it would replace, past those already reading."""
        room = self.limit - len(self._pending)
        if room <= 0:
            return []
        on_disk = ((residency.host_page < 0) & (residency.page < 0) & np.isfinite(heat)
                   & (heat > 0))
        for key in [*residency.broken, *self._pending, *self.unreadable]:
            on_disk[key] = False
        order = np.argsort(-np.where(on_disk, heat, -np.inf), axis=None)[: on_disk.sum()]
        wanted = [tuple(int(i) for i in np.unravel_index(i, heat.shape)) for i in order]
        victims = self._victims(residency, heat)
        chosen: list[Key] = []
        for i, key in enumerate(wanted[:room]):
            j = i + len(self._pending)  # the victim this read would replace
            if j >= len(victims) or not self._hotter(heat, key, victims[j]):
                break
            chosen.append(key)
        return chosen

    def _hotter(self, heat: np.ndarray, key: Key, victim: Key) -> bool:
        return heat[key] > (1 + self.hysteresis) * heat[victim]

    @staticmethod
    def _victims(residency: Residency, heat: np.ndarray) -> list[Key]:
        """Tier-1 experts a read may replace, coldest first: none with a device slot (an
        admission copy may be reading it)."""
        held = [k for k in residency.host_key if k is not None and residency.slot_of(k) is None]
        return sorted(held, key=lambda k: heat[k])
