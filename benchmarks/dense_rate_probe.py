"""Why did the dense decode matmuls of `bench.dense_kernel_gbps` run below the step's? The
seed-125b shape (6 layers, random bf16 weights made on the device) at 16 rows, timed as:
the function itself with the layer scan rolled and unrolled, the rolled scanned layers alone,
the lm head alone, the layers unrolled by hand (each layer's arrays indexed out of the
stacks), and beside them a plain read (`bench._device_read_gbps`, chained). GPU only in
practice.

    python -m benchmarks.dense_rate_probe
"""

import dataclasses
import json

import jax
import jax.numpy as jnp

from strata_jax.model import linear, lm_head, with_shared
from strata_jax.synth import SHAPES
from strata_runtime import bench


def main() -> None:
    cfg = dataclasses.replace(SHAPES["seed-125b"], num_layers=6)
    d, q, kv, fs = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.shared_intermediate_size
    shapes = {"wqkv": (d, q + 2 * kv), "wo": (q, d), "router": (d, cfg.num_experts),
              "shared_w1": (d, fs), "shared_w3": (d, fs), "shared_w2": (fs, d),
              "shared_gate": (d,)}
    keys = iter(jax.random.split(jax.random.key(0), 16))
    draw = jax.jit(lambda k, s: (0.02 * jax.random.normal(k, s)).astype(jnp.bfloat16),
                   static_argnums=1)
    layers = {k: draw(next(keys), (cfg.num_layers, *s)) for k, s in shapes.items()}
    head = {"final_norm": jnp.ones((d,), jnp.bfloat16),
            "lm_head": draw(next(keys), (cfg.vocab_size, d))}
    params = {"params": {**head, "layers": layers}}
    x = draw(next(keys), (16, d))
    out = {"device": jax.devices()[0].device_kind, "rows": 16}
    out["function_rolled"] = bench.dense_kernel_gbps(cfg, params, 16, unroll=False)
    out["function_unrolled"] = bench.dense_kernel_gbps(cfg, params, 16, unroll=True)

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
