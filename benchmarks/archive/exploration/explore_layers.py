"""Exploration: where the B=1 decode time goes (scan vs unrolled layers, experts vs dense)."""
import functools, json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from strata_jax.formats.config import ModelConfig
from strata_jax.formats.checkpoint import dense_layer_shapes, expert_shape
from strata_jax.model import decoder as mdl
from strata_jax.model import moe
from strata_jax.ops import expert_kernels as ek

OUT = os.environ.get("OUT", "/tmp"); res = {}
cfg = ModelConfig(family="mixtral", vocab_size=32000, hidden_size=4096, num_layers=8, num_heads=32,
                  num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, expert_intermediate_size=14336,
                  rope_theta=1e6, rms_eps=1e-5, dtype="bfloat16")
L = cfg.num_layers
keys = iter(jax.random.split(jax.random.PRNGKey(0), 64))
def rand(shape, fan_in): return (jax.random.normal(next(keys), shape, jnp.bfloat16) * fan_in ** -0.5).astype(jnp.bfloat16)
params = {"embed": rand((cfg.vocab_size, cfg.hidden_size), 1), "lm_head": rand((cfg.vocab_size, cfg.hidden_size), cfg.hidden_size),
          "final_norm": jnp.ones((cfg.hidden_size,), jnp.bfloat16)}
params["layers"] = {n: (jnp.ones((L,) + s, jnp.bfloat16) if len(s) == 1 else rand((L,) + s, s[0])) for n, s in dense_layer_shapes(cfg).items()}
pool = moe.ExpertPool(*[rand((L * 8,) + expert_shape(cfg, k), expert_shape(cfg, k)[0]) for k in ("w1", "w3", "w2")])
slot_table = mdl.resident_slot_table(cfg)
per_layer = [{k: v[l] for k, v in params["layers"].items()} for l in range(L)]
jax.block_until_ready((pool, per_layer))
ek.TILES = ek.Tiles(bk=128, bf=64, bd=64, split_k=4)
hbm = 3.69e12

def unrolled_decode(cfg, params, layer_list, pool, slot_table, cache, tokens, positions):
    x = params["embed"][tokens][:, None, :]
    ks, vs = [], []
    for l, lp in enumerate(layer_list):
        x, (k, v) = mdl._decode_layer(cfg, lp, x, positions, cache.k[l], cache.v[l], pool, slot_table[l])
        ks.append(k); vs.append(v)
    return mdl._lm_head(cfg, params, x[:, 0]), mdl.KVCache(jnp.stack(ks), jnp.stack(vs))

def make_loop(step_fn, layers_arg):
    @functools.partial(jax.jit, static_argnames=("steps",))
    def run(params, layers_arg, pool, slot_table, cache, tok, pos, steps):
        def body(i, c):
            tok, cache = c
            lg, cache = step_fn(cfg, params, layers_arg, pool, slot_table, cache, tok, pos + i)
            return jnp.argmax(lg, -1).astype(jnp.int32), cache
        return jax.lax.fori_loop(0, steps, body, (tok, cache))[0]
    return run

scan_step = lambda cfg, params, _l, pool, st, cache, tok, pos: mdl.decode_step(cfg, params, pool, st, cache, tok, pos)
def time_run(run, larg, B, steps=64):
    cache = mdl.init_cache(cfg, B, 128)
    tok = jnp.arange(B, dtype=jnp.int32) + 3; pos = jnp.full((B,), 8, jnp.int32)
    run(params, larg, pool, slot_table, cache, tok, pos, steps).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter(); run(params, larg, pool, slot_table, cache, tok, pos, steps).block_until_ready(); ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / steps

orig = mdl.apply_experts
for variant in ("full", "no_experts"):
    if variant == "no_experts":
        mdl.apply_experts = lambda x, r, p, s: x * r.weights[:, :1].astype(x.dtype)
    for name, step, larg in (("scan", scan_step, None), ("unrolled_static_slice", unrolled_decode, "slice"), ("unrolled_separate", unrolled_decode, per_layer)):
        jax.clear_caches()
        if larg == "slice":
            fn = lambda cfg, params, _l, pool, st, cache, tok, pos: unrolled_decode(cfg, params, [{k: v[l] for k, v in params["layers"].items()} for l in range(L)], pool, st, cache, tok, pos)
            run = make_loop(fn, None); la = None
        else:
            run = make_loop(step, None); la = larg
        for B in (1, 16):
            dt = time_run(run, la, B)
            res[f"{variant}_{name}_B{B}"] = dt * 1e3
            print(variant, name, B, f"{dt*1e3:.3f} ms/step", flush=True)
mdl.apply_experts = orig

# experts alone, 8 layers in one jit
for n, C in ((1, 2), (16, 8)):
    x = jax.random.normal(jax.random.PRNGKey(1), (n, 4096), jnp.bfloat16)
    for tiles in (ek.Tiles(bk=128, bf=64, bd=64, split_k=4), ek.Tiles(), ek.Tiles(bk=128, bf=64, bd=64, split_k=2, num_stages=3),
                  ek.Tiles(bk=64, bf=64, bd=64, split_k=4, num_stages=4), ek.Tiles(bk=128, bf=128, bd=64, split_k=4, num_warps=4, num_stages=3),
                  ek.Tiles(bk=128, bf=64, bd=128, split_k=8, num_warps=4, num_stages=3), ek.Tiles(bk=256, bf=64, bd=64, split_k=4, num_warps=8, num_stages=2)):
        @jax.jit
        def eight(x, pool):
            acc = jnp.zeros((C, n, 4096), jnp.float32)
            for l in range(L):
                slots = (jnp.arange(C, dtype=jnp.int32) + l * 8)
                acc = acc + ek.grouped_swiglu_pallas(x, slots, *pool, tiles=tiles)
            return acc
        try:
            eight(x, pool).block_until_ready()
            ts = []
            for _ in range(10):
                t = time.perf_counter(); eight(x, pool).block_until_ready(); ts.append(time.perf_counter() - t)
        except Exception as e:
            print("fail", tiles, repr(e)[:200]); continue
        dt = float(np.median(ts)); byts = L * C * 3 * 4096 * 14336 * 2
        print(f"experts x8 n={n} C={C} {tiles}: {dt*1e3:.3f} ms, {byts/dt/1e9:.0f} GB/s = {byts/dt/hbm:.2f} of HBM", flush=True)
        res[f"experts_n{n}_{tiles}"] = byts / dt / 1e9
json.dump(res, open(os.path.join(OUT, "explore_layers.json"), "w"), indent=1)
