"""Exploration (session 6): where the int4 gate/up kernel's time goes on the H200.

A stripped copy of `strata_jax/ops/int4_kernel.py`'s gate/up kernel (one CTA per entry and row block)
whose step body can skip parts: `stream` (pipeline only), `nowgmma` (dequantize + scale, fold
into a register sum instead of wgmma), `nodequant` (wgmma on a constant A operand), `noscale`,
and `full`; `postscale`, `perm`, `perm_magic` (the session-6 designs, see ../README.md); and
`pstreamN` (a persistent grid of N CTAs per SM streaming the tiles with an empty body: the
pipeline's ceiling). Prefixes (session 7): `t` reads each step's weight tile from contiguous
memory, as a tile-major storage format would make it (`tstream`, `tperm`; the output then is
not checked), `w` swizzles the weights' smem by the whole step (128 B) instead of one group.
Register-lean variants of `perm` (session 7, for Nsight Compute's finding that 154 registers per
thread hold gate/up to 3 CTAs per SM): `perm0` folds each group's result as soon as its wgmma is
done (one group's converted weights live at a time), `permh` issues each group as two K = 64
wgmmas and keeps at most two halves' registers live; `perm0_magic` is `perm0` with
`perm_magic`'s conversion.
Device kernel time at Mixtral gate/up shapes (8 experts, 16 rows each), 8 layers.

    python3 benchmarks/exploration/int4_diag.py [mode:rows:stages:groups,...]  ->  $OUT/int4_diag.json
"""
import functools
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.getcwd())
from benchmarks.common import device_kernel_times, hbm_bandwidth  # noqa: E402

G = 128


def _swizzled(minor_elems, bits):
    swizzle = plgpu.find_swizzle(minor_elems * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def wgmma_view(w4x, magic=False, halves=False):
    """int4 [rows, 128] loaded in the UPCAST_4X layout -> bf16 in the WGMMA layout with no data
    movement: thread t's 8 nibbles (physical cols 8c..8c+7 of a 32-block) become its 4 WGMMA
    pairs, i.e. logical col 8j + 2c + b <- physical 8c + 2j + b (x is permuted to match).
    magic: bf16 136 + q by prmt + lop3 (CUTLASS's conversion without its subtraction).
    halves: the [rows, 64] halves as two arrays (for K = 64 wgmmas)."""
    half = plgpu.ShapeDtypeStruct((w4x.shape[0], w4x.shape[1] // 2), jnp.bfloat16,
                                  layout=plgpu.Layout.WGMMA)
    whole = plgpu.ShapeDtypeStruct(w4x.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=(half, half) if halves else whole)
    def view(ctx, arr):
        i32 = ir.IntegerType.get_signless(32)
        out_ty = ir.VectorType.get((2,), ir.BF16Type.get())
        regs = arr.registers
        shape = mgpu.WGMMA_LAYOUT.registers_shape(arr.shape)
        assert shape[1] == 4 * regs.shape[1] and shape[2:] == regs.shape[2:], (shape, regs.shape)
        new = np.empty(shape, dtype=object)
        for idx, reg in np.ndenumerate(regs):
            if magic:
                word = mgpu_utils.bitcast(reg, i32)
                hi = arith.shrui(word, arith.constant(i32, 4))
            for j in range(4):
                if magic:
                    out = llvm.inline_asm(
                        i32, [word, hi],
                        f"{{ .reg .b32 s1; prmt.b32 s1, $1, $2, 0xF{j + 4}F{j}; "
                        "lop3.b32 $0, s1, 0x000F000F, 0x43084308, 0x6a; }",
                        "=r,r,r")
                    out = mgpu_utils.bitcast(out, out_ty)
                else:
                    out = mgpu_utils.vector_slice(reg, slice(2 * j, 2 * j + 2))
                new[(idx[0], 4 * idx[1] + j, *idx[2:])] = out
        def convert(regs):
            if magic:
                return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT,
                                            _is_signed=None)
            ints = mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=True)
            return ints.astype(ir.BF16Type.get())
        if halves:  # register columns are 8-column tiles
            n = new.shape[1] // 2
            return convert(new[:, :n]), convert(new[:, n:])
        return convert(new)
    return view(w4x)


def permute_k(x):
    """x [..., K] with each 32-block's [c, a, b] (4, 4, 2) axes swapped to [a, c, b]."""
    *lead, k = x.shape
    return x.reshape(*lead, k // 32, 4, 4, 2).swapaxes(-3, -2).reshape(*lead, k)


BASES = ("full", "stream", "nowgmma", "nodequant", "noscale", "postscale", "perm", "perm_magic",
         "perm0", "permh", "perm0_magic")


def parse_mode(mode):
    """[t][w]base: t = tile-major weights (each step's tile contiguous), w = the weights' smem
    swizzle sized by the whole step (128 B) instead of one group (64 B)."""
    flags = ""
    while mode not in BASES and mode[:1] in ("t", "w"):
        flags, mode = flags + mode[0], mode[1:]
    return mode, "t" in flags, "w" in flags


def gate_up(x, slots, w1, s1, w3, s3, *, rows=64, stages=3, groups=2, mode="full", xs=None):
    mode, tile_major, wide = parse_mode(mode)
    c_n, r, k = x.shape
    o, bo, bk = w1.shape[1], rows, G * groups
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    magic = mode in ("perm_magic", "perm0_magic")
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    def body(slots_ref, x_gmem, w1g, s1g, w3g, s3g, xs_gmem, out_gmem, o_smem):
        c, j = lax.axis_index("c"), lax.axis_index("o")
        slot = slots_ref[c]

        def step_postscale(_, x_smem, *ws, accs, temps):
            if magic:
                ws, xs_smem = ws[:-1], ws[-1]
            # wgmma on the unscaled ints into a fresh accumulator per group; the group's scale
            # is applied to its [rows, R] result (ping-pong temps keep one wgmma in flight)
            units = [(w_smem, s_smem, acc, g) for g in range(groups)
                     for w_smem, s_smem, acc in zip(ws[::2], ws[1::2], accs)]
            zero = plgpu.layout_cast(jnp.zeros((bo, r), jnp.float32), plgpu.Layout.WGMMA)

            def fold(t, s_smem, g, acc, wait_n):
                v = plgpu.wgmma_accumulator_load(t, wait_n=wait_n)
                if magic:
                    xsum = plgpu.load(xs_smem.at[g], (), layout=col_layout)
                    v = v - 136.0 * lax.broadcast_in_dim(xsum, v.shape, [1])
                scale = plgpu.load(s_smem.at[g], (), layout=row_layout).astype(jnp.float32)
                acc[...] = (plgpu.wgmma_accumulator_load(acc, wait_n=None)
                            + v * lax.broadcast_in_dim(scale, v.shape, [0]))

            prev = None
            for i, (w_smem, s_smem, acc, g) in enumerate(units):
                w = plgpu.load(w_smem.at[:, pl.ds(g * G, G)], (),
                               layout=plgpu.Layout.WGMMA_UPCAST_4X)
                t = temps[i % 2]
                t[...] = zero
                if mode == "permh":  # K = 64 halves: at most two halves' A registers live
                    h0, h1 = wgmma_view(w, halves=True)
                    plgpu.wgmma(t, h0, x_smem.at[:, pl.ds(g * G, G // 2)].T)
                    if prev is not None:  # the previous unit's second half is done
                        fold(*prev, wait_n=1)
                    plgpu.wgmma(t, h1, x_smem.at[:, pl.ds(g * G + G // 2, G // 2)].T)
                    plgpu.wgmma_wait(1)  # this unit's first half is done
                    prev = (t, s_smem, g, acc)
                    continue
                if mode == "postscale":
                    w = plgpu.layout_cast(w, plgpu.Layout.WGMMA).astype(jnp.bfloat16)
                else:  # perm, perm_magic, perm0, perm0_magic
                    w = wgmma_view(w, magic)
                plgpu.wgmma(t, w, x_smem.at[:, pl.ds(g * G, G)].T)
                if mode.startswith("perm0"):  # no lag: one unit's A registers live at a time
                    fold(t, s_smem, g, acc, wait_n=0)
                    continue
                if prev is not None:
                    fold(*prev, wait_n=1)
                prev = (t, s_smem, g, acc)
            if prev is not None:
                fold(*prev, wait_n=0)

        def step(_, x_smem, *ws, accs):
            pairs = list(zip(ws[::2], ws[1::2], accs))
            for g, (w_smem, s_smem, acc) in itertools.product(range(groups), pairs):
                cols = pl.ds(g * G, G)
                if mode == "stream":
                    continue
                if mode == "nodequant":
                    w = plgpu.layout_cast(jnp.full((bo, G), 1.0, jnp.bfloat16), plgpu.Layout.WGMMA)
                else:
                    w = plgpu.load(w_smem.at[:, cols], (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
                    w = plgpu.layout_cast(w, plgpu.Layout.WGMMA).astype(jnp.bfloat16)
                    if mode != "noscale":
                        scale = plgpu.load(s_smem.at[g], (), layout=row_layout)
                        w = w * lax.broadcast_in_dim(scale, w.shape, [0])
                if mode == "nowgmma":
                    wf = w.astype(jnp.float32)
                    acc[...] = acc[...] + sum(wf[:, i * r:(i + 1) * r] for i in range(G // r))
                else:
                    plgpu.wgmma(acc, w, x_smem.at[:, cols].T)
            plgpu.wgmma_wait(0)

        def run(*accs):
            accs, temps = accs[:2], accs[2:]
            body_fn = (functools.partial(step_postscale, accs=accs, temps=temps)
                       if temps else functools.partial(step, accs=accs))
            specs = [plgpu.BlockSpec((r, bk), lambda kk: (0, kk), transforms=_swizzled(G, 16))]
            # tstream: each step's tile is 64 x bk/2 contiguous bytes (a tile-major layout)
            w_index = ((lambda kk: (j * (k // bk) + kk, 0)) if tile_major
                       else (lambda kk: (j, kk)))
            for _ in range(2):
                specs += [plgpu.BlockSpec((bo, bk), w_index,
                                          transforms=_swizzled(bk if wide else G, 4)),
                          plgpu.BlockSpec((groups, bo), lambda kk: (kk, j))]
            gm = [x_gmem.at[c], w1g.at[slot], s1g.at[slot], w3g.at[slot], s3g.at[slot]]
            if magic:
                specs.append(plgpu.BlockSpec((groups, r), lambda kk: (kk, 0)))
                gm.append(xs_gmem.at[c])
            plgpu.emit_pipeline(body_fn, grid=(k // bk,),
                                in_specs=specs, max_concurrent_steps=stages)(*gm)
            return tuple(a[...] for a in accs)

        a1, a3 = pl.run_scoped(run, *[plgpu.ACC((bo, r)) for _ in range(
            4 if mode.startswith(("postscale", "perm")) else 2)])
        o_smem[...] = (jax.nn.silu(a1) * a3).astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[c, pl.ds(j * bo, bo)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((c_n, o, r), jnp.bfloat16),
        scratch_types=[plgpu.SMEM((bo, r), jnp.bfloat16)], grid=(c_n, o // bo),
        grid_names=("c", "o"), kernel_name="diag_gate_up",
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True))
    if xs is None:
        xs = jnp.zeros((c_n, k // G, r), jnp.float32)
    if tile_major:  # the same bytes seen as [E, N * K / bk, bk]
        w1, w3 = (w.reshape(w.shape[0], -1, bk) for w in (w1, w3))
    return kernel(slots, x, w1, s1, w3, s3, xs)


def stream_persistent(x, w1, s1, w3, s3, *, per_sm, stages=2, groups=2, rows=64):
    """Pipeline-only ceiling of a persistent grid: per_sm CTAs per SM, each streaming the
    gate/up tiles p, p + P, ... (x, w1, w3 and their scales) through one pipeline, empty body."""
    c_n, r, k = x.shape
    o, bo, bk = w1.shape[1], rows, G * groups
    blocks, tiles = o // bo, c_n * (o // bo)
    ctas = min(tiles, per_sm * int(getattr(jax.devices()[0], "core_count", 132)))
    w1f, w3f = w1.reshape(-1, k), w3.reshape(-1, k)
    s1f, s3f = s1.reshape(-1, o), s3.reshape(-1, o)

    def body(x_gmem, w1g, s1g, w3g, s3g, out_gmem):
        p = lax.axis_index("p")
        mine = lax.div(tiles - p + ctas - 1, ctas)

        def entry_block(i):
            t = p + i * ctas
            return lax.div(t, blocks), lax.rem(t, blocks)

        def w_index(i, kk):
            e, b = entry_block(i)
            return e * blocks + b, kk

        def s_index(i, kk):
            e, b = entry_block(i)
            return e * (k // bk) + kk, b

        specs = [plgpu.BlockSpec((r, bk), lambda i, kk: (entry_block(i)[0], kk),
                                 transforms=_swizzled(G, 16))]
        for _ in range(2):
            specs += [plgpu.BlockSpec((bo, bk), w_index, transforms=_swizzled(G, 4)),
                      plgpu.BlockSpec((groups, bo), s_index)]
        plgpu.emit_pipeline(lambda *_: None, grid=(mine, k // bk), in_specs=specs,
                            max_concurrent_steps=stages)(x_gmem, w1g, s1g, w3g, s3g)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((1,), jnp.float32), grid=(ctas,), grid_names=("p",),
        kernel_name=f"diag_pstream{per_sm}",
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True))
    return kernel(x.reshape(-1, k), w1f, s1f, w3f, s3f)


def main():
    out = os.environ.get("OUT", "/tmp/out")
    d, f, e, layers, r = 4096, 14336, 8, 8, 16
    key = jax.random.PRNGKey(0)
    w = lambda k: lax.bitcast_convert_type(  # noqa: E731
        jax.random.randint(k, (layers * e, f, d // 2), 0, 256, jnp.int32).astype(jnp.uint8),
        jnp.int4).reshape(layers * e, f, d)
    w1, w3 = w(jax.random.fold_in(key, 1)), w(jax.random.fold_in(key, 3))
    s = jax.random.uniform(jax.random.fold_in(key, 5), (layers * e, d // G, f), jnp.float32,
                           0.005, 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(key, (e, r, d), jnp.bfloat16)

    @jax.jit
    def reference(x, w1, w3, s):  # layer 0 in float32 from the dequantized weights
        def dense(wq):
            return wq[:e].astype(jnp.float32) * jnp.repeat(s[:e].astype(jnp.float32), G, 1).mT
        g = jnp.einsum("erk,efk->efr", x.astype(jnp.float32), dense(w1))
        u = jnp.einsum("erk,efk->efr", x.astype(jnp.float32), dense(w3))
        return jax.nn.silu(g) * u
    want = reference(x, w1, w3, s)
    bw = hbm_bandwidth()["read"]
    nbytes = 2 * e * (f * d // 2 + d // G * f * 2)
    results = []
    configs = [("perm", 64, 2, 2), ("perm_magic", 64, 2, 2), ("perm", 64, 2, 1),
               ("perm_magic", 64, 2, 1), ("perm_magic", 64, 3, 1), ("perm_magic", 64, 2, 4)]
    if len(sys.argv) > 1:  # e.g. stream:64:3:4,perm:64:2:2 (mode:rows:stages:groups)
        configs = [(m, int(a), int(b), int(c)) for m, a, b, c in
                   (item.split(":") for item in sys.argv[1].split(","))]
    for mode, rows, stages, groups in configs:
        xin = permute_k(x) if "perm" in mode else x
        xs = xin.astype(jnp.float32).reshape(e, r, d // G, G).sum(-1).swapaxes(1, 2)
        one = lambda x, xs, w1, w3, s, i, mode=mode, t=(rows, stages, groups): gate_up(  # noqa
            x, jnp.arange(e, dtype=jnp.int32) + i * e, w1, s, w3, s, rows=t[0], stages=t[1],
            groups=t[2], mode=mode, xs=xs)
        if mode.startswith("pstream"):  # pstreamN: N persistent CTAs per SM, layer i's experts
            one = lambda x, xs, w1, w3, s, i, n=int(mode[7:]), t=(rows, stages, groups): (  # noqa
                stream_persistent(x, w1[i * e:(i + 1) * e], s[i * e:(i + 1) * e],
                                  w3[i * e:(i + 1) * e], s[i * e:(i + 1) * e], per_sm=n,
                                  rows=t[0], stages=t[1], groups=t[2]))
        fn = jax.jit(lambda *a, one=one: sum(one(*a, i).astype(jnp.float32).sum()
                                            for i in range(layers)))
        try:
            got = jax.jit(one, static_argnums=5)(xin, xs, w1, w3, s, 0).astype(jnp.float32)
            err = (float(jnp.abs(got - want).max() / jnp.abs(want).max())
                   if got.shape == want.shape and not parse_mode(mode)[1]
                   else None)  # stream modes compute nothing; tile-major reads other weights
            fn(xin, xs, w1, w3, s).block_until_ready()
        except Exception as ex:
            results.append({"mode": mode, "tiles": (rows, stages, groups), "error": repr(ex)[:400]})
            print(results[-1], flush=True)
            continue
        ks = device_kernel_times(lambda: fn(xin, xs, w1, w3, s).block_until_ready())
        us = sum(v["us"] for n, v in ks.items() if n.startswith("diag_")) / layers
        results.append({"mode": mode, "tiles": (rows, stages, groups), "us_per_layer": us,
                        "over_hbm": nbytes / us / 1e3 / bw, "rel_err_vs_f32": err})
        print(results[-1], flush=True)
    json.dump({"hbm_read_GBps": bw, "jax": jax.__version__, "results": results},
              open(f"{out}/int4_diag.json", "w"), indent=1)


if __name__ == "__main__":
    main()
