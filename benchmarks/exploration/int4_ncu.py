"""Exploration (session 7): one Mixtral-8x7B layer of the int4 expert kernels (8 experts, 16 own
rows each, the tuned tiles) and the 4 GiB reduction that sets the HBM bound, run a few times
for Nsight Compute:

    ncu --clock-control none -k regex:'int4|reduce' --launch-skip 4 --launch-count 3 \\
        python3 benchmarks/exploration/int4_ncu.py
"""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
from benchmarks.int4_experts import random_int4_pool  # noqa: E402
from strata_jax import int4_kernel  # noqa: E402


def main():
    d, f, e, r = 4096, 14336, 8, 16
    pool = random_int4_pool(jax.random.PRNGKey(1), e, d, f)
    x = jax.random.normal(jax.random.PRNGKey(3), (e, r, d), jnp.bfloat16)
    slots = jnp.arange(e, dtype=jnp.int32)
    tiles = int4_kernel.tiles_for(d, f)
    big = jnp.ones((1 << 30,), jnp.float32)
    reduce = jax.jit(lambda a: a.sum())
    layer = jax.jit(lambda x, p: int4_kernel.grouped_swiglu_int4(x, slots, p, tiles=tiles))
    for _ in range(4):
        layer(x, pool).block_until_ready()
        reduce(big).block_until_ready()
    print("tiles", tiles)


if __name__ == "__main__":
    main()
