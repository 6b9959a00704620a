"""Exploration (session 9): int4 expert weights stored tile by tile (`to_tile_major`).

Why: a kernel step reads a `rows x 256`-input tile of the packed weights: 64 pieces of 128
bytes, one per output row, 2-7 KB apart (a row is D/2 or F/2 bytes). Nsight Compute put DRAM
at 61-73 % of peak in these kernels while a plain contiguous XLA read of the same bytes
reaches 0.93-0.96 of the measured bandwidth (`read_floor.py`). Stored tile-major, each step is
one contiguous 8 KB block. Same bytes, same kernel arithmetic: the outputs must be identical.

Run on a Hopper GPU: `python3 benchmarks/exploration/tile_major.py`: per shape and tiles, the
kernels' device time per layer (weights rotated over layers, so they do not sit in L2) with
row-major and tile-major weights, and whether the two outputs are bit-identical. Arguments:
the cases to run (default all).
"""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
from benchmarks.common import device_kernel_times, hbm_bandwidth  # noqa: E402
from benchmarks.int4_experts import int4_expert_bytes, random_int4_pool  # noqa: E402
from strata_jax.ops import int4_kernel  # noqa: E402
from strata_jax.ops.int4_kernel import Int4Tiles as T  # noqa: E402

CASES = {  # name: (D, F, experts per layer, layers, x rows [entries?, rows], tiles tried)
    "mixtral own rows": (4096, 14336, 8, 8, (8, 16), (
        T(64, 2, 2, down_splits=1, fold_lag=0), T(64, 2, 2, down_splits=2, fold_lag=0),
        T(64, 4, 1, down_splits=2, fold_lag=0))),
    "mixtral 16 tokens": (4096, 14336, 8, 8, (16,), (T(64, 2, 2, down_splits=2),)),
    "qwen3": (2048, 768, 51, 16, (8,), (
        T(64, 2, 2, ctas_per_sm=4, up_splits=2), T(64, 4, 1, ctas_per_sm=4, up_splits=2),
        T(64, 2, 2))),
}


def tiled_pool(pool, tiles):
    return pool.tiled_by(*int4_kernel.weight_tile(tiles))


def kernel_times(x, slots, pool, valid, tiles):
    """The layers' outputs of layer 0, and the int4 kernels' device time per layer by kernel."""
    layers = slots.shape[0]

    @jax.jit
    def run(x, pool):
        return [int4_kernel.grouped_swiglu_int4(x, slots[i], pool, valid, tiles=tiles).sum(1)
                for i in range(layers)]

    out = run(x, pool)[0]
    kernels = device_kernel_times(lambda: jax.block_until_ready(run(x, pool)))
    return out, {n.split("_mosaic")[0]: k["us"] / layers for n, k in kernels.items()
                 if n.startswith("int4")}


def main() -> None:
    bound = hbm_bandwidth()["read"]
    print(f"HBM read {bound:.0f} GB/s", flush=True)
    for name, (d, f, experts, layers, rows, tried) in CASES.items():
        if len(sys.argv) > 1 and name not in sys.argv[1:]:
            continue
        pool = random_int4_pool(jax.random.PRNGKey(1), experts * layers, d, f)
        x = jax.random.normal(jax.random.PRNGKey(2), (*rows, d), jnp.bfloat16)
        slots = jnp.arange(experts * layers, dtype=jnp.int32).reshape(layers, experts)
        valid = jnp.ones((experts,), bool)
        nbytes = experts * int4_expert_bytes(d, f)
        for tiles in tried:
            outs = {}
            for major in (False, True):
                label = "tile-major" if major else "row-major"
                try:
                    outs[major], per = kernel_times(
                        x, slots, tiled_pool(pool, tiles) if major else pool, valid, tiles)
                except Exception as e:  # noqa: BLE001 - a failed variant is reported
                    print(name, tiles, label, f"failed {e!r:.300}", flush=True)
                    continue
                us = sum(per.values())
                print(f"{name} {label} {tiles}: {us:.1f} us "
                      f"({', '.join(f'{n} {v:.1f}' for n, v in per.items())}), "
                      f"{nbytes / us / 1e3 / bound:.3f} of HBM", flush=True)
            if len(outs) == 2:
                same = bool(jnp.array_equal(outs[False], outs[True]))
                print(f"  identical outputs: {same}", flush=True)


if __name__ == "__main__":
    main()
