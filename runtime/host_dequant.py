"""Host-side int4 -> bf16 dequantization (the write-up's path), vectorized and multithreaded.

Kept as a knob (`dequant="host"`) so its cost against in-kernel dequantization is measured:
the host path moves 4x the bytes over PCIe and spends CPU time here. The work is the same
`dequantize_int4` the model uses, compiled by XLA for the host CPU (vectorized code), run for
several matrices at once from a thread pool. It writes the bf16 matrix in the packed bytes'
output-major order [N, K]: the slots' [K, N] order is restored on the device as the expert is
installed (`SlotPool(transposed=...)`), where a transpose costs microseconds; on the host it
more than doubled the time. A bounded LRU cache keeps dequantized hot experts, as the write-up
did.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.quant import GROUP as INT4_GROUP
from strata_jax.quant import dequantize_int4_jnp

_CPU = jax.devices("cpu")[0]


@jax.jit
def _dequantize_bf16(packed, scales):
    return dequantize_int4_jnp(packed, scales, jnp.bfloat16, out_major=True)


class HostDequantizer:
    """Dequantizes packed int4 matrices on the host CPU, with an LRU cache bounded in bytes."""

    def __init__(self, threads: int | None = None, cache_bytes: int = 0,
                 pin: jax.Device | None = None) -> None:
        """`pin`: place results in that device's pinned host memory (a copy from there runs at
        full PCIe rate), else return numpy arrays."""
        self.threads = threads or min(16, os.cpu_count() or 1)
        self._pinned = None
        if pin is not None:
            self._pinned = jax.sharding.SingleDeviceSharding(pin, memory_kind="pinned_host")
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="strata-dequant")
        self._cache: OrderedDict[Hashable, np.ndarray | jax.Array] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._cached = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def dequantize(self, packed: np.ndarray, scales: np.ndarray) -> np.ndarray | jax.Array:
        """packed uint8 [N, K/2] + bf16 scales [K/128, N] -> bfloat16 [N, K], output-major
        (numpy, or a jax array in pinned host memory with `pin`)."""
        n, k = packed.shape[0], packed.shape[1] * 2
        if scales.shape != (k // INT4_GROUP, n):
            raise ValueError(f"scales shape {scales.shape} does not match packed {packed.shape}")
        args = jax.device_put((packed, scales), _CPU)
        out = np.asarray(_dequantize_bf16(*args))
        if self._pinned is None:
            return out
        return jax.block_until_ready(jax.device_put(out, self._pinned))

    def dequantize_many(self, items: Sequence[tuple[np.ndarray, np.ndarray]]) -> list:
        """Several matrices concurrently, one per worker thread."""
        return list(self._pool.map(lambda item: self.dequantize(*item), items))

    def get(self, key: Hashable, packed: np.ndarray, scales: np.ndarray
            ) -> np.ndarray | jax.Array:
        """Cached `dequantize` for the expert weight named by `key`."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key]
            self.misses += 1
        out = self.dequantize(packed, scales)
        self._remember(key, out)
        return out

    def _remember(self, key: Hashable, value: np.ndarray | jax.Array) -> None:
        if value.nbytes > self._cache_bytes:
            return
        with self._lock:
            self._cache[key] = value
            self._cached += value.nbytes
            while self._cached > self._cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached -= old.nbytes

    def close(self) -> None:
        self._pool.shutdown(wait=True)
