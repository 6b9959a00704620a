"""Tiers 1 and 2: expert weights in pinned host memory over the checkpoint's TensorStore chunks.

Tier 1 holds each expert's arrays as jax arrays in the `pinned_host` memory of the GPU (page-
locked, so a host->device copy runs at full PCIe rate and asynchronously), or as plain numpy
arrays when asked (`pinned=False`, e.g. for host-side dequantization, which reads them on the
CPU). Tier 2 reads are verified against the manifest, so a corrupt chunk raises a
`CheckpointError` naming its layer and expert, for the request that needed it only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import jax
import numpy as np

from strata_jax.checkpoint import CheckpointReader

Key = tuple[int, int]  # (layer, expert)


@dataclass
class StoreStats:
    """Expert fetches served by each tier, and their bytes."""

    hits: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 0})
    bytes: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 0})


def pinned_sharding(device: jax.Device) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


class ExpertStore:
    """Serves one expert's arrays: from host memory (tier 1) or from disk (tier 2)."""

    def __init__(self, reader: CheckpointReader, tier1: Iterable[Key] = (),
                 device: jax.Device | None = None, pinned: bool = True,
                 loader: Executor | None = None) -> None:
        """`loader`: threads that read (and pin) tier 1 in parallel, e.g. NUMA-bound ones."""
        self.reader = reader
        self.names = tuple(reader.expert_specs)
        for name in self.names:  # open every array now: fetch threads share them read-only
            reader.expert_store(name)
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._sharding = pinned_sharding(device or jax.devices()[0]) if pinned else None
        keys = list(tier1)
        load = loader.map if loader is not None else map
        self._host = dict(zip(keys, load(self._load, keys), strict=True))

    @property
    def pinned(self) -> bool:
        return self._sharding is not None

    def _read(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        return {n: self.reader.read_expert(layer, expert, n) for n in self.names}

    def _load(self, key: Key) -> dict[str, object]:
        arrays = self._read(*key)
        if self._sharding is None:
            return arrays
        pinned = jax.device_put(list(arrays.values()), self._sharding)
        return dict(zip(arrays, jax.block_until_ready(pinned), strict=True))

    def tier_of(self, layer: int, expert: int) -> int:
        return 1 if (layer, expert) in self._host else 2

    def host_arrays(self, layer: int, expert: int) -> dict[str, object] | None:
        """Tier-1 arrays as stored (pinned jax arrays or numpy), None for tier 2; uncounted."""
        return self._host.get((layer, expert))

    def fetch(self, layer: int, expert: int, count: bool = True) -> dict[str, object]:
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
