"""The pinned host -> device link's rate (`link_rate`): the one measurement of it, which the
engine's stats, the bound's denominator and the bench's ceilings all take."""

from __future__ import annotations

import time

import jax
import numpy as np


def link_rate(device: jax.Device, nbytes: int = 64 << 20, pieces: int = 8) -> float:
    """Pinned host -> device GB/s of `nbytes` moved as `pieces` copies in flight together, as a
    step moves a layer's misses (one copy alone leaves the link part idle): the link-busy
    figures' and the bound's denominator."""
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    xs = [jax.device_put(np.full(nbytes // pieces // 4, i, np.float32), pinned)
          for i in range(pieces)]
    jax.block_until_ready(jax.device_put(xs, on_device))
    t0 = time.perf_counter()
    jax.block_until_ready(jax.device_put(xs, on_device))
    return nbytes // pieces * pieces / max(time.perf_counter() - t0, 1e-9) / 1e9
