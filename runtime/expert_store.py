"""Tiers 1 and 2: expert weights in host memory over the checkpoint's TensorStore chunks."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from strata_jax.checkpoint import CheckpointReader

Key = tuple[int, int]  # (layer, expert)


@dataclass
class StoreStats:
    """Expert fetches served by each tier, and their bytes."""

    hits: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 0})
    bytes: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 0})


class ExpertStore:
    """Serves one expert's arrays: from host memory (tier 1) or from disk (tier 2).

    Tier-2 reads are verified against the manifest, so a corrupt chunk raises a
    `CheckpointError` naming its layer and expert, for the request that needed it only.
    """

    def __init__(self, reader: CheckpointReader, tier1: Iterable[Key] = ()) -> None:
        self.reader = reader
        self.names = tuple(reader.expert_specs)
        for name in self.names:  # open every array now: fetch threads share them read-only
            reader.expert_store(name)
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._host: dict[Key, dict[str, np.ndarray]] = {k: self._read(*k) for k in tier1}

    def _read(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        return {n: self.reader.read_expert(layer, expert, n) for n in self.names}

    def tier_of(self, layer: int, expert: int) -> int:
        return 1 if (layer, expert) in self._host else 2

    def fetch(self, layer: int, expert: int, count: bool = True) -> dict[str, np.ndarray]:
        """The expert's arrays from the tier holding it; `count=False` for initial placement."""
        tier = self.tier_of(layer, expert)
        arrays = self._host[(layer, expert)] if tier == 1 else self._read(layer, expert)
        if not count:
            return arrays
        with self._lock:
            self.stats.hits[tier] += 1
            self.stats.bytes[tier] += sum(a.nbytes for a in arrays.values())
        return arrays

    @property
    def host_experts(self) -> int:
        return len(self._host)

    @property
    def host_bytes(self) -> int:
        return sum(a.nbytes for arrays in self._host.values() for a in arrays.values())
