"""Probe host->device transfer behaviour on the GPU: bandwidth by size and layout, whether a
transfer issued while compute is queued overlaps it, and the cost of a donated slot install.

Run on the device: `python3 -m benchmarks.transfer_probe --out $OUT`. Writes transfer_probe.json.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import median_time


def pinned(x: np.ndarray, dev) -> jax.Array:
    s = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    return jax.device_put(x, s)


def to_device(x, dev):
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(dev, memory_kind="device"))


def timed(fn, reps: int = 5) -> float:
    return median_time(fn, reps=reps)


@functools.partial(jax.jit, donate_argnums=0)
def install(pool, slot, value):
    return jax.lax.dynamic_update_index_in_dim(pool, value, slot, 0)


@jax.jit
def spin(a, n):
    return jax.lax.fori_loop(0, n, lambda i, v: jnp.tanh(v @ v) * 0.5, a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/out")
    args = ap.parse_args()
    dev = jax.devices()[0]
    res: dict[str, object] = {"device": dev.device_kind, "jax": jax.__version__}
    rng = np.random.default_rng(0)
    # 1. bandwidth of device_put from pinned host, by size, one array or a list
    for mb in (16, 64, 117, 352, 1024):
        n = mb * 2**20 // 2
        h = pinned(rng.standard_normal(n, np.float32).astype(jnp.bfloat16), dev)
        dt = timed(lambda h=h: jax.block_until_ready(to_device(h, dev)))
        res[f"put_{mb}MiB_GBps"] = n * 2 / dt / 1e9
    n = 117 * 2**20 // 2
    hs = [pinned(rng.standard_normal(n, np.float32).astype(jnp.bfloat16), dev) for _ in range(12)]
    for k in (3, 6, 12):
        dt = timed(lambda k=k: jax.block_until_ready(to_device(hs[:k], dev)))
        res[f"put_list{k}x117MiB_GBps"] = k * n * 2 / dt / 1e9
        dt = timed(lambda k=k: jax.block_until_ready([to_device(h, dev) for h in hs[:k]]))
        res[f"put_each{k}x117MiB_GBps"] = k * n * 2 / dt / 1e9
    # pageable numpy source
    npx = np.asarray(rng.standard_normal(n, np.float32).astype(jnp.bfloat16))
    dt = timed(lambda: jax.block_until_ready(to_device(npx, dev)))
    res["put_numpy_117MiB_GBps"] = n * 2 / dt / 1e9
    # 2. install cost: 117 MiB into a donated pool of 8 slots
    pool = jnp.zeros((8, n), jnp.bfloat16)
    v = to_device(hs[0], dev)
    state = {"pool": pool}

    def inst():
        state["pool"] = install(state["pool"], jnp.int32(3), v)
        jax.block_until_ready(state["pool"])

    res["install_117MiB_ms"] = timed(inst) * 1e3
    # 3. overlap: transfer 6x117 MiB issued before vs after a ~60 ms compute
    a = jnp.ones((4096, 4096), jnp.bfloat16) * 0.01
    iters = 1
    while timed(lambda n=iters: jax.block_until_ready(spin(a, n)), 2) < 0.06:
        iters *= 2
    t_spin = timed(lambda: jax.block_until_ready(spin(a, iters)), 3)
    t_put = timed(lambda: jax.block_until_ready(to_device(hs[:6], dev)), 3)

    def before():
        p = to_device(hs[:6], dev)
        s = spin(a, iters)
        jax.block_until_ready((p, s))

    def after():
        s = spin(a, iters)
        p = to_device(hs[:6], dev)
        jax.block_until_ready((p, s))

    def after_idle_then_install():
        # transfer then an install program that consumes it, queued behind compute
        s = spin(a, iters)
        p = to_device(hs[0], dev)
        state["pool"] = install(state["pool"], jnp.int32(1), p)
        jax.block_until_ready((s, state["pool"]))

    res.update(spin_ms=t_spin * 1e3, put6_ms=t_put * 1e3,
               before_ms=timed(before, 3) * 1e3, after_ms=timed(after, 3) * 1e3,
               after_install_ms=timed(after_idle_then_install, 3) * 1e3)
    for k, val in res.items():
        print(f"{k:32s} {val}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "transfer_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
