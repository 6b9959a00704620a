"""Does a program see a `device_put` into `pinned_host` memory that was not waited for?

A diagnostic for the GPU machine (docs/design.md, "Disk stalls"). Each trial puts a numpy
buffer of known bits into `pinned_host` memory and, without waiting for the transfer, runs a
program that copies a slice of it to the device and sums it (uint32, wrapping: the same sum
numpy gives). Variants:

- `kept`: the numpy buffer stays referenced until the program is done;
- `dropped`: the last reference to the numpy buffer goes right after the `device_put`, and a
  buffer of other bits of the same size is written at once (it may reuse the freed memory);
- `waited`: as `dropped`, but `jax.block_until_ready` on the put first (what the engine does).

Each row: variant, size, trials and how many sums were wrong.

    python -m benchmarks.pinned_put_probe --out $OUT [--sizes-mb 64,1024] [--trials 20]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def _checksum(host: jax.Array, start: jax.Array) -> jax.Array:
    """The wrapping uint32 sum of rows [start, start + half) of `host`, read on the device."""
    half = host.shape[0] // 2
    piece = jax.lax.dynamic_slice_in_dim(host, start, half, 0)
    return jnp.sum(jax.device_put(piece, jax.memory.Space.Device), dtype=jnp.uint32)


def _trial(variant: str, rows: int, seed: int, sharding) -> bool:
    """Whether the program's sum equals numpy's for one fresh buffer."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, size=(rows, 1 << 16), dtype=np.uint32)
    start = int(rng.integers(0, rows // 2 + 1))
    want = np.sum(bits[start : start + rows // 2], dtype=np.uint32)
    host = jax.device_put(bits, sharding)
    if variant == "waited":
        host = jax.block_until_ready(host)
    if variant != "kept":
        del bits
        other = np.full((rows, 1 << 16), seed + 1, np.uint32)  # may take the freed pages
    got = _checksum(host, jnp.int32(start))
    ok = int(got) == int(want)
    if variant != "kept":
        del other
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes-mb", default="64,1024", help="buffer sizes, comma-separated")
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args()
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "pinned_put_probe.jsonl", "a") as f:
        for mb in (int(s) for s in args.sizes_mb.split(",")):
            rows = max(2, (mb << 20) // (4 << 16))
            for variant in ("kept", "dropped", "waited"):
                t0 = time.perf_counter()
                wrong = sum(not _trial(variant, rows, s, sharding) for s in range(args.trials))
                row = dict(variant=variant, mb=mb, trials=args.trials, wrong=wrong,
                           seconds=round(time.perf_counter() - t0, 2),
                           device=device.device_kind, jax=jax.__version__,
                           date=time.strftime("%Y-%m-%d"))
                print(json.dumps(row), flush=True)
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
