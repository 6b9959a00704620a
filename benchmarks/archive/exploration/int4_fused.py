"""Exploration (session 8, not yet run on a GPU): gate/up and down of the int4 experts in ONE
kernel launch per layer.

Why: a plain read of Qwen3-30B-A3B's per-layer expert bytes split as the two kernels read them
(83 MB gate/up, then 42 MB down) already takes 34 us, the 0.8 target itself
(`read_floor.py`): each launch pays a ramp-up and a tail. One launch pays them once.

How: `P = SMs x ctas_per_sm` persistent CTAs, which must all be resident at once (a CTA may wait
for others; 115 registers and ~57 KB of shared memory per CTA here: 3 per SM, never 4).
Phase 1: CTA p takes gate/up tiles p, p + P, ... (the library's step, `multiply_step`), writes
each tile's h = silu(gate) * up as bf16 rows of `h [C, F, R]` (rows permuted within each block of
32 into the down weights' register order, so no XLA transpose or permute sits between the
phases), then signals its entry's global semaphore. Phase 2: CTA p takes down tiles p, p + P,
...; the fetch of an entry's first h block waits until that entry's semaphore has counted all
of its gate/up tiles (fetched after the step's weights, so those are already on the way). h is
the wgmma B operand as stored, [K, N] with N = R (rows padded to 16: 32-byte rows, swizzled).
Down multiplies in bf16 (h's range is not known ahead, float16 would need its max).

Run on a Hopper GPU: `python3 benchmarks/exploration/int4_fused.py` checks it against the XLA
path and times it beside the two-kernel path (device time, Qwen3 and Mixtral shapes).
"""
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.getcwd())
from strata_jax.ops.int4_kernel import (  # noqa: E402
    GROUP, Int4Tiles, _operand, _swizzled, as_int4, multiply_step, sm_count, tiles_for)
from strata_jax.ops.pool import ExpertPool  # noqa: E402

ROWS = 16  # activation rows padded to 16: h's rows are 32 bytes, the smallest wgmma swizzle


def store_rows_for_down(h, ref):
    """Store h [64, R] (WGMMA layout) into ref [64, R] with row 8c + 2a + b of each block of 32
    at 8a + 2c + b: `permute_k`'s bf16 order, the order the down kernel multiplies inputs in."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, vector

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(_, array, smem):
        index = ir.IndexType.get()

        def const(v):
            return arith.constant(index, v)

        for (row, col), reg_idx in zip(array.layout.thread_idxs(array.shape),
                                       np.ndindex(array.registers.shape), strict=True):
            a = arith.andi(arith.shrui(row, const(1)), const(3))
            c = arith.andi(arith.shrui(row, const(3)), const(3))
            within = arith.ori(arith.ori(arith.shli(a, const(3)), arith.shli(c, const(1))),
                               arith.andi(row, const(1)))
            prow = arith.ori(arith.andi(row, const(~31)), within)
            vector.store(array.registers[reg_idx], smem, [prow, col])

    store(h, ref)


def hand_over_h(accs, scale, o_smem, h_dst, sem) -> None:
    """A gate/up tile's end: h = silu(gate) * up from its sums (zeroed for the next tile),
    stored at `h_dst` in down's input order, then its entry's semaphore counts it."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    h = jax.nn.silu(accs[0][...] * scale) * (accs[1][...] * scale)
    for acc in accs:
        acc[...] = plgpu.layout_cast(jnp.zeros(acc.shape, acc.dtype), plgpu.Layout.WGMMA)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    store_rows_for_down(h.astype(jnp.bfloat16), o_smem)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, h_dst)
    plgpu.wait_smem_to_gmem(0)  # written before the entry's count goes up
    pl.semaphore_signal(sem, 1)


def fused_inputs(x, valid, c_n: int):
    """The activations as float16 rows padded to ROWS (`_operand`), their scale, the valid
    mask, the entries' order (valid first), their count [1], and the rows before/after padding."""
    x3 = x if x.ndim == 3 else x[None]
    n0 = x3.shape[1]
    r = -(-n0 // ROWS) * ROWS
    valid = jnp.ones((c_n,), bool) if valid is None else valid != 0
    xp, x_scale = _operand(jnp.pad(x3, ((0, 0), (0, r - n0), (0, 0))), True, valid)
    order = jnp.argsort(~valid, stable=True)
    return xp, x_scale, valid, order, jnp.sum(valid, dtype=jnp.int32).reshape(1), n0, r


def fused_swiglu_int4(x, slots, pool: ExpertPool, valid=None, tiles: Int4Tiles | None = None,
                      ctas_per_sm: int = 3):
    """Partial sums [C, 1, N, D] float32, `grouped_swiglu_int4`'s contract, in one launch."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    d, f = x.shape[-1], pool.intermediate_size
    tiles = dataclasses.replace(tiles or tiles_for(d, f), up_splits=1, down_splits=1,
                                ctas_per_sm=0, compute_wgs=1, fold_lag=0)
    up_tiles, down_tiles = tiles, dataclasses.replace(tiles, f16=False)
    xp, x_scale, valid, order, n_valid, n0, r = fused_inputs(x, valid, slots.shape[0])
    c_n = slots.shape[0]
    bo, bk = tiles.rows, GROUP * tiles.groups
    blocks1, blocks2, k1, k2 = f // bo, d // bo, d // bk, f // bk
    ctas = sm_count() * ctas_per_sm
    shared_x = xp.shape[0] == 1

    def body(order_ref, n_ref, slots_ref, x_scale_ref, x_gmem, w1, s1, w3, s3, w2, s2,
             y_gmem, h_gmem, o1_smem, o2_smem):
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((c_n,)))
        p = lax.axis_index("p")

        def tiles_of(blocks):  # this CTA's count of a phase's tiles, and tile i's indices
            total = n_ref[0] * blocks
            mine = lax.div(jnp.maximum(total - p + ctas - 1, 0), ctas)

            def tile(i):
                t = p + i * ctas
                entry = order_ref[lax.div(t, blocks)]
                return entry, slots_ref[entry], lax.rem(t, blocks)
            return mine, tile

        mine1, tile1 = tiles_of(blocks1)
        mine2, tile2 = tiles_of(blocks2)

        def finish1(i, accs):
            entry, _, block = tile1(i)
            hand_over_h(accs, x_scale_ref[0], o1_smem,
                        h_gmem.at[pl.ds(entry * f + block * bo, bo)], sems.at[entry])

        def step1(idx, x_smem, *weight_smem, accs, temps):
            multiply_step(lambda g: x_smem.at[:, pl.ds(g * GROUP, GROUP)].T, weight_smem,
                          accs, temps, up_tiles)
            pl.when(idx[1] == k1 - 1)(lambda: finish1(idx[0], accs))

        def finish2(i, accs):
            entry, _, block = tile2(i)
            y = accs[0][...]
            accs[0][...] = plgpu.layout_cast(jnp.zeros(y.shape, y.dtype), plgpu.Layout.WGMMA)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o2_smem[...] = y
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o2_smem, y_gmem.at[pl.ds(entry * d + block * bo, bo)])

        def step2(idx, w_smem, s_smem, h_smem, *, accs, temps):
            multiply_step(lambda g: h_smem.at[pl.ds(g * GROUP, GROUP)], (w_smem, s_smem), accs,
                          temps, down_tiles)
            pl.when(idx[1] == k2 - 1)(lambda: finish2(idx[0], accs))

        def h_index(i, kk):  # the entry's h is complete before its first block is fetched
            entry, _, _ = tile2(i)
            pl.when(kk == 0)(
                lambda: pl.semaphore_wait(sems.at[entry], blocks1, decrement=False))
            return entry * k2 + kk, 0

        def phase1(*refs):
            accs, temps = refs[:2], refs[2:]
            specs = [plgpu.BlockSpec(
                (r, bk), lambda i, kk: ((0 if shared_x else tile1(i)[0]), kk),
                transforms=_swizzled(GROUP, 16))]
            for _ in range(2):
                specs += [plgpu.BlockSpec(
                              (bo, bk), lambda i, kk: (tile1(i)[1] * blocks1 + tile1(i)[2], kk),
                              transforms=_swizzled(GROUP, 4)),
                          plgpu.BlockSpec(
                              (tiles.groups, bo), lambda i, kk: (tile1(i)[1] * k1 + kk,
                                                                 tile1(i)[2]))]
            plgpu.emit_pipeline(functools.partial(step1, accs=accs, temps=temps),
                                grid=(mine1, k1), in_specs=specs,
                                max_concurrent_steps=tiles.stages)(x_gmem, w1, s1, w3, s3)

        def phase2(*refs):
            accs, temps = refs[:1], refs[1:]
            specs = [plgpu.BlockSpec(
                         (bo, bk), lambda i, kk: (tile2(i)[1] * blocks2 + tile2(i)[2], kk),
                         transforms=_swizzled(GROUP, 4)),
                     plgpu.BlockSpec(
                         (tiles.groups, bo), lambda i, kk: (tile2(i)[1] * k2 + kk, tile2(i)[2])),
                     plgpu.BlockSpec((bk, r), h_index, transforms=_swizzled(r, 16))]
            plgpu.emit_pipeline(functools.partial(step2, accs=accs, temps=temps),
                                grid=(mine2, k2), in_specs=specs,
                                max_concurrent_steps=tiles.stages)(w2, s2, h_gmem)

        pl.run_scoped(phase1, *[plgpu.ACC((bo, r)) for _ in range(4)])
        pl.run_scoped(phase2, *[plgpu.ACC((bo, r)) for _ in range(3)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((c_n * d, r), jnp.float32),
                        jax.ShapeDtypeStruct((c_n * f, r), jnp.bfloat16)),
        scratch_types=[plgpu.SMEM((bo, r), jnp.bfloat16), plgpu.SMEM((bo, r), jnp.float32)],
        grid=(ctas,), grid_names=("p",), kernel_name="int4_fused",
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True))
    weights = [a for w, s in ((pool.w1, pool.w1_scale), (pool.w3, pool.w3_scale),
                              (pool.w2, pool.w2_scale))
               for a in (as_int4(w).reshape(-1, w.shape[-1] * 2), s.reshape(-1, s.shape[-1]))]
    y, _ = kernel(order.astype(jnp.int32), n_valid, slots.astype(jnp.int32), x_scale,
                  xp.reshape(-1, d), *weights)
    y = jnp.where(valid[:, None, None], y.reshape(c_n, d, r), 0.0)
    return jnp.swapaxes(y, 1, 2)[:, None, :n0]


def main() -> None:
    from benchmarks.common import hbm_bandwidth
    from benchmarks.int4_experts import int4_expert_bytes, random_int4_pool
    from strata_jax.ops import expert_kernels as ek
    from strata_jax.ops import int4_kernel

    bound = hbm_bandwidth()["read"]
    for name, (d, f, entries, active, rows) in {
            "qwen3": (2048, 768, 64, 51, 8), "mixtral": (4096, 14336, 8, 8, 16)}.items():
        pool = random_int4_pool(jax.random.PRNGKey(1), entries, d, f)
        xs = [jax.random.normal(jax.random.PRNGKey(k), (1, rows, d), jnp.bfloat16)
              for k in (2, 3)]
        slots = jnp.arange(entries, dtype=jnp.int32)
        valid = jnp.arange(entries) < active
        wants = [ek.grouped_swiglu_xla(x[0], slots, pool, valid).sum(1) for x in xs]
        nbytes = active * int4_expert_bytes(d, f)
        for label, fn in (
                ("two kernels", jax.jit(lambda x, p: int4_kernel.grouped_swiglu_int4(
                    x[0], slots, p, valid))),
                *((f"fused, {c} CTAs/SM", jax.jit(functools.partial(
                    lambda x, p, c: fused_swiglu_int4(x[0], slots, p, valid, ctas_per_sm=c),
                    c=c))) for c in (2, 3))):
            report(f"{name} {label}", lambda x, fn=fn: fn(x, pool).sum(1), xs, wants, nbytes,
                   bound)


def report(label, call, xs, wants, nbytes, bound, per: int = 1) -> None:
    """Print `call`'s int4 kernels' device time (per `per` layers), its share of the HBM bound
    and its error vs XLA on each input (a stale semaphore count would show as an error)."""
    from benchmarks.common import device_kernel_times

    try:
        err = max(float(jnp.abs(call(x) - want).max() / jnp.abs(want).max())
                  for x, want in zip(xs, wants, strict=True))
        kernels = device_kernel_times(lambda: jax.block_until_ready(call(xs[0])))
        us = sum(k["us"] for n, k in kernels.items() if n.startswith("int4")) / per
        print(f"{label}: {us:.1f} us, {nbytes / us / 1e3 / bound:.3f} of HBM, "
              f"error vs XLA {err:.1e}", flush=True)
    except Exception as e:  # noqa: BLE001 - a failed variant is reported, not fatal
        print(f"{label}: failed {e!r:.400}", flush=True)


if __name__ == "__main__":
    main()
