"""Exploration: decode-step variants for resident Mixtral-8x7B shape (8 layers, bf16) on GPU."""
import functools, json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from strata_jax.formats.config import ModelConfig
from strata_jax.formats.checkpoint import dense_layer_shapes, global_shapes, expert_shape
from strata_jax import api
from strata_jax.model import decoder as mdl
from strata_jax.model import moe

OUT = os.environ.get("OUT", "/tmp")
res = {"variant": sys.argv[1] if len(sys.argv) > 1 else "base", "xla_flags": os.environ.get("XLA_FLAGS", "")}
print(jax.devices(), jax.__version__, flush=True)

def hbm_bw():
    x = jnp.ones((1 << 30,), jnp.float32)  # 4 GB
    f = jax.jit(lambda a: a * 1.0001 + 1)
    f(x).block_until_ready()
    ts = []
    for _ in range(10):
        t = time.perf_counter(); f(x).block_until_ready(); ts.append(time.perf_counter() - t)
    return 2 * x.nbytes / np.median(ts)

res["hbm_GBps"] = hbm_bw() / 1e9
print("HBM", res["hbm_GBps"], flush=True)

cfg = ModelConfig(family="mixtral", vocab_size=32000, hidden_size=4096, num_layers=8, num_heads=32,
                  num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, expert_intermediate_size=14336,
                  rope_theta=1e6, rms_eps=1e-5, dtype="bfloat16")

def rand(key, shape, fan_in):
    if len(shape) == 1 or (len(shape) == 2 and shape[0] == cfg.num_layers and fan_in is None):
        return jnp.ones(shape, jnp.bfloat16)
    return (jax.random.normal(key, shape, jnp.bfloat16) * (fan_in ** -0.5)).astype(jnp.bfloat16)

key = jax.random.PRNGKey(0)
keys = iter(jax.random.split(key, 64))
L = cfg.num_layers
params = {"embed": jax.random.normal(next(keys), (cfg.vocab_size, cfg.hidden_size), jnp.bfloat16),
          "lm_head": rand(next(keys), (cfg.vocab_size, cfg.hidden_size), cfg.hidden_size),
          "final_norm": jnp.ones((cfg.hidden_size,), jnp.bfloat16)}
layers = {}
for name, s in dense_layer_shapes(cfg).items():
    layers[name] = jnp.ones((L,) + s, jnp.bfloat16) if len(s) == 1 else rand(next(keys), (L,) + s, s[0])
params["layers"] = layers
pool = moe.ExpertPool(*[rand(next(keys), (L * cfg.num_experts,) + expert_shape(cfg, k), expert_shape(cfg, k)[0]) for k in ("w1", "w3", "w2")])
slot_table = mdl.resident_slot_table(cfg)
jax.block_until_ready(pool)
dense_bytes = sum(v.nbytes for v in layers.values()) + params["lm_head"].nbytes
expert_bytes = sum(3 * np.prod(expert_shape(cfg, "w1")) * 2 for _ in [0])
print("dense GB", dense_bytes / 1e9, "expert MB", expert_bytes / 1e6, flush=True)

from strata_jax.ops import expert_kernels as ek
def bench(f, *a, reps=20):
    f(*a).block_until_ready()
    ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(*a).block_until_ready(); ts.append(time.perf_counter()-t)
    return float(np.median(ts))
configs = [ek.Tiles(), ek.Tiles(bf=32, bd=32, split_k=2), ek.Tiles(bk=64, bf=32, bd=32, split_k=4, num_stages=6),
           ek.Tiles(bk=128, bf=32, bd=32, split_k=4, num_warps=4, num_stages=4),
           ek.Tiles(bk=256, bf=32, bd=32, split_k=2, num_warps=8, num_stages=3),
           ek.Tiles(bk=128, bf=64, bd=64, split_k=4, num_warps=4, num_stages=4),
           ek.Tiles(bk=128, bf=32, bd=32, split_k=8, num_warps=2, num_stages=5)]
best = {}
for n, C in ((1, 2), (16, 8)):
    x = jax.random.normal(jax.random.PRNGKey(n), (n, cfg.hidden_size), jnp.bfloat16)
    slots = jnp.arange(C, dtype=jnp.int32) * 7 % pool.num_slots
    byts = C * expert_bytes
    xla_t = bench(jax.jit(ek.grouped_swiglu_xla), x, slots, *pool)
    print(f"n={n} C={C} xla {xla_t*1e3:.3f} ms {byts/xla_t/1e9:.0f} GB/s", flush=True)
    res[f"xla_n{n}"] = byts / xla_t / 1e9
    ref = np.asarray(ek.grouped_swiglu_xla(x, slots, *pool))
    for t in configs:
        try:
            f = functools.partial(ek.grouped_swiglu_pallas, tiles=t)
            dt = bench(f, x, slots, *pool)
            err = float(np.abs(np.asarray(f(x, slots, *pool)) - ref).max() / np.abs(ref).max())
        except Exception as e:
            print("tiles", t, "failed", repr(e)[:300], flush=True); continue
        gbs = byts / dt / 1e9
        print(f"n={n} C={C} {t} {dt*1e3:.3f} ms {gbs:.0f} GB/s ratio {gbs*1e9/(res['hbm_GBps']*1e9):.2f} err {err:.2e}", flush=True)
        res[f"pallas_n{n}_{t}"] = gbs
        if gbs > best.get(n, (0, None))[0]: best[n] = (gbs, t)
print("best", best, flush=True)
ek.TILES = best[1][1]

def time_decode(B, steps=64):
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(8)] for i in range(B)]
    lengths = np.full((B,), 8, np.int32)
    tokens = np.array(prompts, np.int32)
    first, cache = api._prefill_first(cfg, params, pool, slot_table, tokens, lengths, 128)
    out = api._greedy_decode(cfg, params, pool, slot_table, cache, first, lengths, steps)
    out.block_until_ready()
    ts = []
    for _ in range(5):
        first, cache = api._prefill_first(cfg, params, pool, slot_table, tokens, lengths, 128)
        jax.block_until_ready(cache)
        t = time.perf_counter()
        out = api._greedy_decode(cfg, params, pool, slot_table, cache, first, lengths, steps)
        out.block_until_ready()
        ts.append(time.perf_counter() - t)
    return np.median(ts) / steps, np.asarray(out)

for tiles_name, tiles in (("best1", best[1][1]), ("best16", best[16][1])):
    ek.TILES = tiles
    jax.clear_caches()
    for B in (1, 16):
        dt, toks = time_decode(B)
        uniq = 2 if B == 1 else 8 * (1 - (6 / 8) ** 16)
        bytes_step = dense_bytes + L * uniq * expert_bytes
        bound = bytes_step / (res["hbm_GBps"] * 1e9)
        res[f"{tiles_name}_B{B}"] = dict(ms=dt * 1e3, tok_s=B / dt, bound_ms=bound * 1e3, ratio=bound / dt)
        print(tiles_name, B, res[f"{tiles_name}_B{B}"], flush=True)
# dense-only step: top_k experts forced to a zero-cost path is not possible; time attention+lm_head alone
with open(os.path.join(OUT, f"explore_{res['variant']}.json"), "w") as f: json.dump(res, f, indent=1, default=str)
