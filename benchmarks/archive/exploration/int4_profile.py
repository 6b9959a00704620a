"""Exploration: where the int4 expert kernel's time goes on the GPU.

Device kernel times from a profiler trace (gate/up vs down vs XLA glue), the Mixtral shape at
16 and 32 rows (does the row count, i.e. tensor-core work, matter?), and three diagnostic
gate/up kernels over the same grid and bytes: stream only, stream + dequant, stream + dots
without dequant. Writes $OUT/int4_profile.json.
"""
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from benchmarks.common import device_kernel_times as kernel_times
from benchmarks.common import median_time
from benchmarks.int4_experts import SHAPES, int4_expert_bytes, random_int4_pool, routing
from strata_jax.ops import expert_kernels as ek

OUT = os.environ.get("OUT", "/tmp")
BEST = {
    "mixtral-8x7b": dataclasses.replace(ek.TILES_INT4, asm=True),
    "qwen3-30b-a3b": dataclasses.replace(ek.TILES_INT4, asm=True, split_k=1, bd=256),
}


def setup(shape, tokens=None):
    tokens = tokens or shape.tokens
    pool = random_int4_pool(jax.random.PRNGKey(1), shape.layers * shape.experts, shape.d, shape.f)
    shape = dataclasses.replace(shape, tokens=tokens)
    ids, counts, _ = routing(shape, 2)
    slots = jnp.asarray(ids + (np.arange(shape.layers) * shape.experts)[:, None])
    valid = jnp.asarray(np.take_along_axis(counts, ids, axis=1) > 0)
    x = jax.random.normal(jax.random.PRNGKey(3), (tokens, shape.d), jnp.bfloat16)
    active = int(valid.sum())
    return pool, slots, valid, x, active


def full(shape, tiles, tokens=None):
    pool, slots, valid, x, active = setup(shape, tokens)

    @jax.jit
    def run(x, slots, valid, pool):
        return sum(ek.grouped_swiglu_pallas(x, slots[i], pool, tiles=tiles, valid=valid[i]).sum()
                   for i in range(shape.layers))
    fn = lambda: run(x, slots, valid, pool).block_until_ready()  # noqa: E731
    return fn, active * int4_expert_bytes(shape.d, shape.f) / shape.layers


def diag_kernel(slots_ref, x_ref, w1_ref, w3_ref, o_ref, *, tiles, mode, nk):
    c, j = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[c]
    half = tiles.bk // 2
    n = x_ref.shape[0]
    if mode == "dots":
        cols = pl.ds(j * (tiles.bf // 2), tiles.bf // 2)
    else:
        cols = pl.ds(j * tiles.bf, tiles.bf)

    def body(k, acc):
        p1 = w1_ref[slot, pl.ds(k * half, half), cols]
        p3 = w3_ref[slot, pl.ds(k * half, half), cols]
        if mode == "stream":
            return acc ^ p1 ^ p3
        if mode == "dequant":
            planes = ek._asm_nibbles(p1, True) + ek._asm_nibbles(p3, True)
            m = functools.reduce(jnp.maximum, planes)
            return jnp.maximum(acc, m)
        xs = [x_ref[:, pl.ds(((k + i // 2) % nk) * tiles.bk + (i % 2) * half, half)]
              for i in range(4)]
        out = acc
        for i, w in enumerate((p1, p1, p3, p3)):
            out += jnp.dot(xs[i], w, preferred_element_type=jnp.float32)
        return out

    if mode == "stream":
        zero = jnp.zeros((half, tiles.bf), jnp.uint8)
    elif mode == "dequant":
        zero = jnp.zeros((half, tiles.bf), jnp.bfloat16)
    else:
        zero = jnp.zeros((n, tiles.bf // 2), jnp.float32)
    acc = jax.lax.fori_loop(0, nk, body, zero)
    o_ref[...] = acc[None].astype(o_ref.dtype)


def wt_kernel(slots_ref, x_ref, w1_ref, w3_ref, s1_ref, s3_ref, o_ref, *, tiles, asm, nk):
    """Gate/up with transposed int4 storage W^T [F, K/2]: weight tiles [bf, 64] are the dot's
    left operand with no transpose (tensor cores can take them from registers)."""
    c, j = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[c]
    half = tiles.bk // 2
    rows = pl.ds(j * tiles.bf, tiles.bf)

    def one(w_ref, s_ref, k, x_lo, x_hi):
        p = w_ref[slot, rows, pl.ds(k * half, half)]
        if asm:
            lo, hi = ek._asm_nibbles(p, True)
        else:
            lo, hi = (ek._magic_nibbles(q, jnp.bfloat16) for q in (p & 0xF, p >> 4))
        acc = jnp.dot(lo, x_lo.T, preferred_element_type=jnp.float32)
        acc += jnp.dot(hi, x_hi.T, preferred_element_type=jnp.float32)
        return acc * s_ref[slot, rows, pl.ds(k, 1)].astype(jnp.float32)

    def body(k, accs):
        x_lo = x_ref[:, pl.ds(k * tiles.bk, half)]
        x_hi = x_ref[:, pl.ds(k * tiles.bk + half, half)]
        return (accs[0] + one(w1_ref, s1_ref, k, x_lo, x_hi),
                accs[1] + one(w3_ref, s3_ref, k, x_lo, x_hi))

    n = x_ref.shape[0]
    zero = jnp.zeros((tiles.bf, n), jnp.float32)
    a1, a3 = jax.lax.fori_loop(0, nk, body, (zero, zero))
    o_ref[...] = (jax.nn.silu(a1) * a3).astype(o_ref.dtype)[None]


def diag_wt(shape, tiles, asm, tokens=None):
    pool, slots, valid, x, active = setup(shape, tokens)
    n = max(16, x.shape[0])
    xp = jnp.zeros((n, shape.d), x.dtype).at[: x.shape[0]].set(x)
    s_count = shape.layers * shape.experts
    wt = lambda k: jax.random.randint(  # noqa: E731
        k, (s_count, shape.f, shape.d // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    w1, w3 = wt(jax.random.PRNGKey(5)), wt(jax.random.PRNGKey(6))
    del pool
    sc = jnp.full((s_count, shape.f, shape.d // 128), 0.01, jnp.bfloat16)
    call = pl.pallas_call(
        functools.partial(wt_kernel, tiles=tiles, asm=asm, nk=shape.d // tiles.bk),
        grid=(slots.shape[1], shape.f // tiles.bf),
        out_shape=jax.ShapeDtypeStruct((slots.shape[1], shape.f, n), jnp.bfloat16),
        out_specs=pl.BlockSpec((1, tiles.bf, n), lambda c, j: (c, j, 0)),
        compiler_params=ek._compiler_params(tiles))

    @jax.jit
    def run(xp, slots, w1, w3, sc):
        return sum(call(slots[i], xp, w1, w3, sc, sc).astype(jnp.float32).sum()
                   for i in range(shape.layers))
    fn = lambda: run(xp, slots, w1, w3, sc).block_until_ready()  # noqa: E731
    return fn, slots.shape[1] * 2 * (shape.d * shape.f // 2) * 1.0


def diag(shape, tiles, mode):
    pool, slots, valid, x, active = setup(shape)
    n = max(16, x.shape[0])
    xp = jnp.zeros((n, shape.d), x.dtype).at[: x.shape[0]].set(x)
    nk = shape.d // tiles.bk
    w1, w3 = pool.w1, pool.w3
    if mode == "dots":  # the same bytes read as bf16 tiles: tensor-core work, no dequant
        as_bf16 = lambda w: jax.lax.bitcast_convert_type(  # noqa: E731
            w.reshape(*w.shape[:-1], w.shape[-1] // 2, 2), jnp.bfloat16)
        w1, w3 = as_bf16(w1), as_bf16(w3)
        out = jax.ShapeDtypeStruct((slots.shape[1], n, shape.f // 2), jnp.float32)
        spec = pl.BlockSpec((1, n, tiles.bf // 2), lambda c, j: (c, 0, j))
    else:
        dt = jnp.uint8 if mode == "stream" else jnp.bfloat16
        out = jax.ShapeDtypeStruct((slots.shape[1], tiles.bk // 2, shape.f), dt)
        spec = pl.BlockSpec((1, tiles.bk // 2, tiles.bf), lambda c, j: (c, 0, j))
    call = pl.pallas_call(
        functools.partial(diag_kernel, tiles=tiles, mode=mode, nk=nk),
        grid=(slots.shape[1], shape.f // tiles.bf), out_shape=out, out_specs=spec,
        compiler_params=ek._compiler_params(tiles))

    @jax.jit
    def run(xp, slots, w1, w3):
        return sum(call(slots[i], xp, w1, w3).astype(jnp.float32).sum()
                   for i in range(shape.layers))
    fn = lambda: run(xp, slots, w1, w3).block_until_ready()  # noqa: E731
    # gate/up bytes of every listed slot (diagnostics do not skip padding)
    return fn, slots.shape[1] * 2 * (shape.d * shape.f // 2) * 1.0


def main():
    res = {"jax": jax.__version__, "device": jax.devices()[0].device_kind}
    only = sys.argv[1:] or ["profile", "rows", "diag", "warps", "wt"]
    for shape in SHAPES:
        tiles = ek.tiles_for(shape.d, shape.f, base=BEST[shape.name], quantized=True)
        r = res[shape.name] = {"tiles": str(tiles)}
        if "profile" in only:
            fn, nbytes = full(shape, tiles)
            r["kernels_per_call"] = kernel_times(fn)
            r["wall_us_per_layer"] = median_time(fn, reps=10) / shape.layers * 1e6
            print(shape.name, json.dumps(r, indent=1), flush=True)
        if "rows" in only:
            for tokens in (8, 16, 32):
                fn, nbytes = full(shape, tiles, tokens)
                dt = median_time(fn, reps=10) / shape.layers
                r[f"tokens{tokens}_us"] = dt * 1e6
                r[f"tokens{tokens}_GBps"] = nbytes / dt / 1e9
                print(shape.name, tokens, dt * 1e6, nbytes / dt / 1e9, flush=True)
        if "warps" in only:
            for tokens in (16, 32):
                for warps in (2, 4, 8):
                    t = dataclasses.replace(tiles, num_warps=warps)
                    fn, nbytes = full(shape, t, tokens)
                    dt = median_time(fn, reps=10) / shape.layers
                    r[f"tokens{tokens}_warps{warps}_GBps"] = nbytes / dt / 1e9
                    print(shape.name, tokens, warps, nbytes / dt / 1e9, flush=True)
        if "wt" in only:
            for tokens in (16, 32):
                for asm in (True, False):
                    for warps in (4, 8):
                        t = dataclasses.replace(tiles, num_warps=warps)
                        key = f"wt_tokens{tokens}_asm{asm}_warps{warps}"
                        try:
                            fn, nbytes = diag_wt(shape, t, asm, tokens)
                            dt = median_time(fn, reps=10) / shape.layers
                            r[key + "_GBps"] = nbytes / dt / 1e9
                        except Exception as e:  # noqa: BLE001
                            r[key + "_error"] = repr(e)[:300]
                        print(shape.name, key, r.get(key + "_GBps"), r.get(key + "_error"),
                              flush=True)
            fn, nbytes = diag_wt(shape, tiles, True)
            r["wt_kernels"] = kernel_times(fn, reps=3)
            print(r["wt_kernels"], flush=True)
        if "diag" in only:
            for mode in ("stream", "dequant", "dots"):
                try:
                    fn, nbytes = diag(shape, tiles, mode)
                    dt = median_time(fn, reps=10) / shape.layers
                    r[f"diag_{mode}_GBps"] = nbytes / dt / 1e9
                    r[f"diag_{mode}_kernels"] = kernel_times(fn, reps=3)
                except Exception as e:  # noqa: BLE001
                    r[f"diag_{mode}_error"] = repr(e)[:300]
                print(shape.name, mode, r.get(f"diag_{mode}_GBps"), r.get(f"diag_{mode}_error"),
                      flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(f"{OUT}/int4_profile.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
