"""How fast does a decode step read its dense weights? The seed-125b shape (6 layers, random
bf16 weights made on the device) at 16 rows, timed as: `bench.dense_kernel_gbps` (the step
without its experts) with the layer scan rolled and unrolled; its dense matmuls alone, the
layers scanned rolled and unrolled by hand (each layer's arrays indexed out of the stacks);
the lm head alone; and beside them a plain read (`bench._device_read_gbps`, chained). GPU
only in practice.

    python -m benchmarks.dense_rate_probe
"""

import dataclasses
import json

import jax
import jax.numpy as jnp

from strata_jax.formats.checkpoint import global_shapes
from strata_jax.model.decoder import linear, lm_head, with_shared
from strata_jax.model.flax_model import layer_specs
from strata_jax.tools.synth import SHAPES
from strata_runtime.lab import bench


def main() -> None:
    cfg = dataclasses.replace(SHAPES["seed-125b"], num_layers=6)
    d, q = cfg.hidden_size, cfg.q_size
    keys = iter(jax.random.split(jax.random.key(0), 64))
    draw = jax.jit(lambda k, s: (0.02 * jax.random.normal(k, s)).astype(jnp.bfloat16),
                   static_argnums=1)
    layers = {k: draw(next(keys), (cfg.num_layers, *v.shape))
              for k, v in layer_specs(cfg).items()}
    glob = {k: draw(next(keys), v) for k, v in global_shapes(cfg).items()}
    head = {"final_norm": glob["final_norm"], "lm_head": glob["lm_head"]}
    params = {"params": {**glob, "layers": layers}}
    x = draw(next(keys), (16, d))
    out = {"device": jax.devices()[0].device_kind, "rows": 16}
    for unroll in (False, True):  # the step without its experts, a cache of 2,048 positions
        out[f"function_{'un' * unroll}rolled"] = bench.dense_kernel_gbps(cfg, params, 16, 2048,
                                                                          unroll)

    def layer(x, lp):
        qkv = linear(x, lp, "wqkv")
        x = x + linear(qkv[:, :q], lp, "wo")
        return jnp.tanh(with_shared(cfg, lp, x, x)), x @ lp["router"]

    def rate(fn, *args):
        nbytes = sum(a.nbytes for a in jax.tree.leaves(args[1:]))
        run = jax.jit(fn)
        return nbytes / bench._best(lambda: jax.block_until_ready(run(*args)), 20) / 1e9

    out["layers_scanned"] = rate(lambda x, ls: jax.lax.scan(layer, x, ls), x, layers)
    out["lm_head"] = rate(lambda x, h: lm_head(cfg, h, x), x, head)

    def unrolled(x, ls):
        for i in range(cfg.num_layers):
            x, _ = layer(x, {k: v[i] for k, v in ls.items()})
        return x

    out["layers_unrolled"] = rate(unrolled, x, layers)
    out["plain_read"] = bench._device_read_gbps(jax.devices()[0], 2 << 30, 10, 1.0, bench.CHAIN)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
