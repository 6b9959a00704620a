"""Exploration: an int4 expert matmul in Pallas Mosaic GPU (Hopper), weights fed to wgmma as the
A operand straight from registers (no shared-memory round trip of dequantized tiles).

out^T[c, o, r] = sum_k W[slot_c, o, k] * x[c, r, k], W int4 [E, O, K] (K contiguous) with bf16
scales [E, K / 128, O]; dequantized in registers as bf16(q * scale).

    python3 benchmarks/exploration/mgpu_int4.py   ->  $OUT/mgpu_int4.json
"""
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BK = 128  # one scale group per pipeline step


def _swizzled(minor_elems: int, bits: int):
    swizzle = plgpu.find_swizzle(minor_elems * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def int4_matmul_t(x, slots, valid, weights, *, bo=64, stages=4, epilogue=None, out_dtype=None,
                  nab=False):
    """x [C, R, K] bf16; weights: tuple of (w int4 [E, O, K], s bf16 [E, K/BK, O]).
    Returns epilogue(*accs) as [C, O, R] (accs f32 [bo, R] per weight)."""
    c_n, r, k = x.shape
    o = weights[0][0].shape[1]
    nw = len(weights)
    out_dtype = out_dtype or x.dtype
    epilogue = epilogue or (lambda a: a)
    row = plgpu.Layout.WGMMA.reduce(1)

    def body(slots_ref, valid_ref, x_gmem, *refs):
        w_gmem = refs[: 2 * nw]
        out_gmem, o_smem = refs[2 * nw:]
        c, j = lax.axis_index("c"), lax.axis_index("o")
        slot = slots_ref[c]

        def step(_, x_smem, *ws, accs):
            for i in range(nw):
                w_smem, s_smem = ws[2 * i], ws[2 * i + 1]
                w = plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
                w = plgpu.layout_cast(w, plgpu.Layout.WGMMA).astype(jnp.bfloat16)
                s = plgpu.load(s_smem.at[0], (), layout=row)
                w = w * lax.broadcast_in_dim(s, w.shape, [0])
                plgpu.wgmma(accs[i], w, x_smem.T)
            plgpu.wgmma_wait(0)
            return accs

        def run(*accs):
            specs = [plgpu.BlockSpec((r, BK), lambda kk: (0, kk), transforms=_swizzled(BK, 16))]
            for _ in range(nw):
                specs += [plgpu.BlockSpec((bo, BK), lambda kk: (j, kk), transforms=_swizzled(BK, 4)),
                          plgpu.BlockSpec((1, bo), lambda kk: (kk, j))]
            gm = [x_gmem.at[c]] + [ref.at[slot] for ref in w_gmem]
            plgpu.emit_pipeline(
                lambda idx, *smem: step(idx, *smem, accs=accs),
                grid=(k // BK,), in_specs=specs, max_concurrent_steps=stages)(*gm)
            return tuple(a[...] for a in accs)

        @pl.when(valid_ref[c] != 0)
        def _():
            accs = pl.run_scoped(lambda *a: run(*a), *[plgpu.ACC((bo, r)) for _ in range(nw)])
            o_smem[...] = epilogue(*accs).astype(out_dtype)

        @pl.when(valid_ref[c] == 0)
        def _():
            o_smem[...] = jnp.zeros((bo, r), out_dtype)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[c, pl.ds(j * bo, bo)])
        plgpu.wait_smem_to_gmem(0)

    args = [a for pair in weights for a in pair]
    kern = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((c_n, o, r), out_dtype),
        scratch_types=[plgpu.SMEM((bo, r), out_dtype)],
        grid=(c_n, o // bo), grid_names=("c", "o"),
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=nab))
    return kern(slots.astype(jnp.int32), valid.astype(jnp.int32), x, *args)


def int4_matmul_ws(x, slots, valid, weights, *, bo=64, stages=4, epilogue=None,
                   out_dtype=None, wgs=2, name="int4_matmul", delay=0, scale=True, nab=False):
    """Same contract, warp-specialized: a memory warpgroup keeps `stages` TMA steps in flight;
    `wgs` compute warpgroups each own bo output rows of the CTA's wgs * bo."""
    c_n, r, k = x.shape
    o = weights[0][0].shape[1]
    nw = len(weights)
    out_dtype = out_dtype or x.dtype
    epilogue = epilogue or (lambda a: a)
    row = plgpu.Layout.WGMMA.reduce(1)
    cta = wgs * bo

    def body(slots_ref, valid_ref, x_gmem, *refs):
        w_gmem = refs[: 2 * nw]
        out_gmem, o_smem = refs[2 * nw:]
        c, j = lax.axis_index("c"), lax.axis_index("o")
        wg = lax.axis_index("wg")
        slot = slots_ref[c]
        rows = pl.ds(wg * bo, bo)

        def step(_, x_smem, *ws):
            ws, carry = ws[:-1], ws[-1]
            for i in range(nw):
                w_smem, s_smem = ws[2 * i], ws[2 * i + 1]
                w = plgpu.load(w_smem.at[rows], (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
                w = plgpu.layout_cast(w, plgpu.Layout.WGMMA).astype(jnp.bfloat16)
                if scale:
                    sc = plgpu.load(s_smem.at[0, rows], (), layout=row)
                    w = w * lax.broadcast_in_dim(sc, w.shape, [0])
                plgpu.wgmma(carry[i], w, x_smem.T)
            plgpu.wgmma_wait(nw if delay else 0)
            return carry

        def context(eval_pipeline):
            def scoped(*accs):
                eval_pipeline(tuple(accs))
                vals = tuple(a[...] for a in accs)
                o_smem.at[wg][...] = epilogue(*vals).astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], out_gmem.at[c, pl.ds(j * cta + wg * bo, bo)])
                plgpu.wait_smem_to_gmem(0)
            pl.run_scoped(scoped, *[plgpu.ACC((bo, r)) for _ in range(nw)])

        specs = [plgpu.BlockSpec((r, BK), lambda kk: (0, kk), transforms=_swizzled(BK, 16),
                                 delay_release=delay)]
        for _ in range(nw):
            specs += [plgpu.BlockSpec((cta, BK), lambda kk: (j, kk), transforms=_swizzled(BK, 4),
                                      delay_release=delay),
                      plgpu.BlockSpec((1, cta), lambda kk: (kk, j), delay_release=delay)]
        pipe = plgpu.emit_pipeline_warp_specialized(
            step, grid=(k // BK,), memory_registers=40, in_specs=specs, wg_axis="wg",
            num_compute_wgs=wgs, max_concurrent_steps=stages, compute_context=context)

        @pl.when(valid_ref[c] != 0)
        def _():
            pipe(x_gmem.at[c], *[ref.at[slot] for ref in w_gmem])

        @pl.when((valid_ref[c] == 0) & (wg < wgs))
        def _():
            o_smem.at[wg][...] = jnp.zeros((bo, r), out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], out_gmem.at[c, pl.ds(j * cta + wg * bo, bo)])
            plgpu.wait_smem_to_gmem(0)

    args = [a for pair in weights for a in pair]
    kern = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((c_n, o, r), out_dtype),
        scratch_types=[plgpu.SMEM((wgs, bo, r), out_dtype)],
        grid=(c_n, o // cta), grid_names=("c", "o"), num_threads=wgs + 1, thread_name="wg",
        kernel_name=name, compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=nab))
    return kern(slots.astype(jnp.int32), valid.astype(jnp.int32), x, *args)


def swiglu_t(x, slots, valid, w1, s1, w3, s3, w2, s2, *, bo=64, stages=4, bo2=64, stages2=4,
             ws=False, wgs=2, delay=0, scale=True, nab=False):
    """Grouped SwiGLU on int4 experts: y [C, R, D] float32."""
    mm = (functools.partial(int4_matmul_ws, wgs=wgs, delay=delay, scale=scale, nab=nab) if ws
          else functools.partial(int4_matmul_t, nab=nab))
    kw = {"name": "gate_up"} if ws else {}
    h_t = mm(x, slots, valid, ((w1, s1), (w3, s3)), bo=bo, stages=stages,
             epilogue=lambda a1, a3: jax.nn.silu(a1) * a3, **kw)
    h = jnp.swapaxes(h_t, 1, 2)
    kw = {"name": "down"} if ws else {}
    y_t = mm(h, slots, valid, ((w2, s2),), bo=bo2, stages=stages2, out_dtype=jnp.float32, **kw)
    return jnp.swapaxes(y_t, 1, 2)


def reference(x, slots, w1, s1, w3, s3, w2, s2):
    def deq(w, s):  # [E, O, K], [E, G, O] -> bf16 [E, O, K]
        sk = jnp.repeat(jnp.swapaxes(s, 1, 2), BK, axis=2)
        return (w.astype(jnp.float32) * sk.astype(jnp.float32)).astype(jnp.bfloat16)
    hi = lax.Precision.HIGHEST
    f32 = jnp.float32
    x32 = x.astype(f32)
    g = jnp.einsum("crk,cok->cro", x32, deq(w1, s1)[slots].astype(f32), precision=hi)
    u = jnp.einsum("crk,cok->cro", x32, deq(w3, s3)[slots].astype(f32), precision=hi)
    h = (jax.nn.silu(g) * u).astype(jnp.bfloat16).astype(f32)
    return jnp.einsum("cro,cdo->crd", h, deq(w2, s2)[slots].astype(f32), precision=hi)


def make(e, d, f, c, r, seed=0):
    ks = jax.random.split(jax.random.key(seed), 8)

    def w(key, o, i):
        return jax.random.randint(key, (e, o, i), -8, 8, jnp.int8).astype(jnp.int4)

    def s(key, o, i):
        return (jax.random.uniform(key, (e, i // BK, o), jnp.float32, 0.5, 1.5) / 64).astype(
            jnp.bfloat16)
    x = jax.random.normal(ks[0], (c, r, d), jnp.bfloat16)
    slots = jax.random.permutation(ks[1], e)[:c].astype(jnp.int32)
    return x, slots, (w(ks[2], f, d), s(ks[3], f, d), w(ks[4], f, d), s(ks[5], f, d),
                      w(ks[6], d, f), s(ks[7], d, f))


VARIANTS = [dict(ws=False, stages=4), dict(ws=False, stages=4, nab=True),
            dict(ws=True, wgs=2, stages=4, bo=128), dict(ws=True, wgs=2, stages=4, bo=128, nab=True)]
LAYERS = 8
SHAPES = {"mixtral": (8, 4096, 14336, 8), "qwen3": (128, 2048, 768, 64)}


def bitcast_probe(res):
    """uint8 pool bytes -> int4 [E, O, K] inside a jit: a free bitcast, or a copy?"""
    from benchmarks.common import median_time
    u8 = jax.random.randint(jax.random.key(3), (8, 14336, 2048), 0, 255, jnp.int32).astype(
        jnp.uint8)
    as_int4 = jax.jit(lambda u: lax.bitcast_convert_type(u, jnp.int4).reshape(8, 14336, 4096))
    nib = jax.jit(lambda u: lax.bitcast_convert_type(u, jnp.int4))(u8[:1, :1, :1])
    res["int4_order"] = {"byte": int(u8[0, 0, 0]), "first_two": [int(v) for v in
                         nib.astype(jnp.int8)[0, 0, 0]]}
    res["bitcast_us"] = median_time(lambda: as_int4(u8).block_until_ready(), reps=20) * 1e6
    res["bitcast_hlo"] = as_int4.lower(u8).compile().as_text()[-3000:]
    print(res["int4_order"], res["bitcast_us"], flush=True)
    x, slots, ws = make(8, 4096, 14336, 8, 16)

    def from_u8(u, o, i):
        return lax.bitcast_convert_type(u, jnp.int4).reshape(8, o, i)

    def packed_call(u1, s1, u3, s3, u2, s2):
        return swiglu_t(x, slots, jnp.ones((8,), jnp.int32), from_u8(u1, 14336, 4096), s1,
                        from_u8(u3, 14336, 4096), s3, from_u8(u2, 4096, 14336), s2)
    us = [jax.lax.bitcast_convert_type(w.reshape(8, w.shape[1], -1, 2), jnp.uint8)
          if w.dtype == jnp.int4 else w for w in ws]
    hlo = jax.jit(packed_call).lower(*us).compile().as_text()
    res["packed_call_copies"] = [ln for ln in hlo.splitlines() if " copy(" in ln][:10]
    print("copies in packed call:", res["packed_call_copies"], flush=True)


def main():
    sys.path.insert(0, os.getcwd())
    from benchmarks.common import device_kernel_times, hbm_bandwidth, machine, median_time
    out = os.environ.get("OUT", "/tmp")
    res = {**machine(), "hbm_GBps": hbm_bandwidth(), "rows": []}
    bw = res["hbm_GBps"]["read"]
    if os.environ.get("BITCAST"):
        bitcast_probe(res)
    for name, (e, d, f, c) in SHAPES.items():
        x, slots, ws = make(e, d, f, c, 16)
        valid = jnp.ones((c,), jnp.int32)
        ref = reference(x, slots, *ws)
        nbytes = sum(a[slots].nbytes if a.dtype != jnp.int4 else a[slots].size // 2 for a in ws)
        for var in VARIANTS:
            row = {"shape": name, **var}
            try:
                kw = {**var, "stages2": var.get("stages", 4), "bo2": var.get("bo", 64)}
                fn = jax.jit(functools.partial(swiglu_t, **kw))
                y = fn(x, slots, valid, *ws)
                row["rel_err"] = float(jnp.abs(y - ref).max() / jnp.abs(ref).max())
                dt = median_time(lambda fn=fn: fn(x, slots, valid, *ws).block_until_ready(),
                                 reps=20)
                kt = device_kernel_times(lambda fn=fn: fn(x, slots, valid, *ws).block_until_ready())
                kus = sum(v["us"] for v in kt.values())

                def layered(x, fn=fn):
                    for _ in range(LAYERS):
                        x = fn(x, slots, valid, *ws).astype(x.dtype)
                    return x
                lay = jax.jit(layered)
                row["us_per_layer_in_jit"] = median_time(
                    lambda: lay(x).block_until_ready(), reps=10) * 1e6 / LAYERS
                lk = device_kernel_times(lambda: lay(x).block_until_ready(), reps=3)
                row["kernel_us_per_layer_in_jit"] = sum(v["us"] for v in lk.values()) / LAYERS
                row.update(us=dt * 1e6, kernel_us=kus, kernels=kt,
                           over_hbm=nbytes / dt / 1e9 / bw, kernel_over_hbm=nbytes / kus / 1e3 / bw)
            except Exception as ex:  # noqa: BLE001
                row["error"] = repr(ex)[:1500]
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                   if k != "kernels"}, flush=True)
            res["rows"].append(row)
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/mgpu_int4.json", "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
