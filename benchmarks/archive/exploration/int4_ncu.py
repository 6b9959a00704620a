"""Exploration (session 7): one Mixtral-8x7B layer of the int4 expert kernels (8 experts, 16 own
rows each, the tuned tiles) and the 4 GiB reduction that sets the HBM bound, run a few times
for Nsight Compute:

    ncu --clock-control none -k regex:'int4|reduce' --launch-skip 4 --launch-count 3 \\
        python3 benchmarks/exploration/int4_ncu.py [mixtral|qwen3] [Int4Tiles field=value ...]

`qwen3` (session 8): a Qwen3-30B-A3B layer instead, 51 of 64 entries valid (the benchmark's
mean), 8 rows shared by all. Session 9: the pool is tile-major for the tiles (the engine's
layout on Hopper); the argument `row-major` keeps it as stored.
"""
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
from benchmarks.int4_experts import random_int4_pool  # noqa: E402
from strata_jax.ops import int4_kernel  # noqa: E402


def main():
    shape, *fields = sys.argv[1:] or ["mixtral"]
    d, f, e, r, valid = ((2048, 768, 64, 8, 51) if shape == "qwen3" else (4096, 14336, 8, 16, 8))
    pool = random_int4_pool(jax.random.PRNGKey(1), e, d, f)
    x = jax.random.normal(jax.random.PRNGKey(3), (1, r, d) if shape == "qwen3" else (e, r, d),
                          jnp.bfloat16)
    slots, ok = jnp.arange(e, dtype=jnp.int32), jnp.arange(e) < valid
    tiles = int4_kernel.tiles_for(d, f)
    row_major = "row-major" in fields
    knobs = {k: int(v) for k, v in (a.split("=") for a in fields if a != "row-major")}
    tiles = dataclasses.replace(tiles, **knobs)
    if not row_major:
        pool = pool.tiled_by(*int4_kernel.weight_tile(tiles))
    big = jnp.ones((1 << 30,), jnp.float32)
    reduce = jax.jit(lambda a: a.sum())
    layer = jax.jit(lambda x, p: int4_kernel.grouped_swiglu_int4(x, slots, p, ok, tiles=tiles))
    for _ in range(4):
        layer(x, pool).block_until_ready()
        reduce(big).block_until_ready()
    print("tiles", tiles)


if __name__ == "__main__":
    main()
