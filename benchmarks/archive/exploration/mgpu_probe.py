"""Exploration: is the Mosaic GPU route to the
int4 kernel's 0.8-of-HBM target worth building?

Times JAX's own Hopper mixed-type matmul (`hopper_mixed_type_matmul_mgpu`: int8 A tiles
dequantized in registers and fed to wgmma as the A operand, bf16 B from shared memory, TMA
pipeline, warp specialization) at the expert kernels' skinny shape: A = W^T [F, D] int8 (the
weights, K-contiguous), B = x^T [D, n] with n = 16 / 32 tokens. If its int8 bytes/s approach
the HBM read bound there, the same structure with int4 tiles (Mosaic has an int4 -> bf16
register upcast) is the plan for issue 3; if not, the bound lies elsewhere.

    python3 benchmarks/exploration/mgpu_probe.py   ->  $OUT/mgpu_probe.json
"""
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.common import hbm_bandwidth, machine, median_time

OUT = os.environ.get("OUT", "/tmp")
SHAPES = {"mixtral w1 (F=14336, D=4096)": (14336, 4096), "qwen3 w1 (F=768, D=2048)": (768, 2048)}


def main():
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as hm

    res = {**machine(), "hbm_GBps": hbm_bandwidth(), "rows": []}
    bw = res["hbm_GBps"]["read"]
    for (name, (f, d)), n in itertools.product(SHAPES.items(), (16, 32)):
        a = jax.random.randint(jax.random.key(0), (f, d), -128, 127, jnp.int8)
        b = jax.random.normal(jax.random.key(1), (d, n), jnp.bfloat16)
        ref = jnp.dot(a.astype(jnp.bfloat16), b, preferred_element_type=jnp.float32)
        for tile_m, tile_k, steps, wg in itertools.product(
                (64, 128), (128, 256), (4, 6), (hm.MatmulDimension.M,)):
            row = {"shape": name, "n": n, "tiles": (tile_m, tile_k, steps, str(wg))}
            try:
                cfg = hm.TuningConfig(tile_m=tile_m, tile_n=n, tile_k=tile_k,
                                      max_concurrent_steps=steps, epi_tile_n=n, epi_tile_m=64,
                                      wg_dimension=wg)
                run = jax.jit(functools.partial(hm.mixed_matmul_kernel, out_dtype=jnp.float32,
                                                config=cfg))
                out = run(a, b)
                err = float(jnp.abs(out - ref).max() / jnp.abs(ref).max())
                dt = median_time(lambda run=run: run(a, b).block_until_ready(), reps=20)
                gbs = a.nbytes / dt / 1e9
                row.update(us=dt * 1e6, GBps=gbs, over_hbm=gbs / bw, rel_err=err)
            except Exception as e:  # noqa: BLE001 (configs that do not fit are reported)
                row["error"] = repr(e)[:200]
            res["rows"].append(row)
            print(row, flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(f"{OUT}/mgpu_probe.json", "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
