"""Exploration (session 8): how fast one XLA read kernel streams a buffer of the int4 kernels'
sizes, by device time, against the 4 GiB read that `int4_experts.py` takes as the HBM bound.

Each size is read from 16 distinct buffers in turn (none of them left in the 60 MB L2 by the
one before), so the figure is what a kernel of that many bytes can get from HBM, ramp-up and
tail included."""
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
from benchmarks.common import device_kernel_times, hbm_bandwidth, machine  # noqa: E402

SIZES_MB = (21, 42, 83, 125, 242, 484, 726)  # Qwen3 down/gate-up/both, Mixtral down/gate-up/both
COPIES = 16


def floor(mb: float) -> dict:
    n = int(mb * 1e6) // 4
    bufs = [jnp.full((n,), i + 1, jnp.uint32) for i in range(COPIES)]
    read = jax.jit(lambda bs: [jnp.sum(b) for b in bs])
    kernels = device_kernel_times(lambda: jax.block_until_ready(read(bufs)), reps=5)
    us = sum(k["us"] for k in kernels.values()) / COPIES
    return {"MB": mb, "us_per_read": us, "GBps": n * 4 / us / 1e3,
            "kernels_per_read": sum(k["count"] for k in kernels.values()) / COPIES}


def main() -> None:
    bound = hbm_bandwidth()["read"]
    rows = [floor(mb) for mb in SIZES_MB]
    print(f"4 GiB read: {bound:.0f} GB/s ({machine()})")
    print("| MB | us per read | GB/s | / 4 GiB read | kernels |\n|---|---|---|---|---|")
    for r in rows:
        r["over_bound"] = r["GBps"] / bound
        print(f"| {r['MB']} | {r['us_per_read']:.1f} | {r['GBps']:.0f} | "
              f"{r['over_bound']:.2f} | {r['kernels_per_read']:.0f} |")
    out = os.environ.get("OUT", "/tmp")
    json.dump({"machine": machine(), "bound_GBps": bound, "rows": rows},
              open(f"{out}/read_floor.json", "w"), indent=1)


if __name__ == "__main__":
    main()
