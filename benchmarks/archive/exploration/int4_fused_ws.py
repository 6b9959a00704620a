"""Exploration (session 9, not yet run on a GPU): gate/up and down of the int4 experts in ONE
launch per layer, warp-specialized, with one pipeline streaming both phases.

Why: the two-kernel layer of Qwen3-30B-A3B experts (83 MB gate/up, then 42 MB down) already
costs the 0.8 target's 34 us as two plain reads (`read_floor.py`); `int4_fused.py` (one launch,
two back-to-back pipelines, 3 CTAs per SM) was correct but slower (54.6 vs 44.2 us). Here:

- one CTA per SM (all resident: a CTA may wait for others), warp-specialized: a TMA warpgroup
  and two compute warpgroups, each on 64 rows of a 128-row tile (`compute_wgs=2`);
- ONE hand-written pipeline of `stages` slots over this CTA's gate/up steps and then its down
  steps: the TMA warpgroup never drains between the phases, it goes on to the first down tile's
  weights while the compute warpgroups finish the last gate/up tile;
- tile-major weights (`pool.tile_major`, one contiguous block per step);
- gate/up tiles store h = silu(gate) * up as bf16 rows of h [C, F, 16] in the down kernel's
  input order (`int4_fused.store_rows_for_down`) and count their entry's global semaphore up;
  the TMA warpgroup waits for an entry's full count before it fetches the entry's first h block
  (the wgmma B operand stored [K, N], N = 16 rows); down multiplies in bfloat16.

Run on a Hopper GPU: `python3 benchmarks/exploration/int4_fused_ws.py` checks it against the XLA
path on two inputs and times it beside the library's two kernels (device time). Without a GPU,
`mosaic_regs.py script:int4_fused_ws` compiles it (registers, spills).
"""
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from int4_fused import fused_inputs, hand_over_h, report  # noqa: E402

from strata_jax.ops.int4_kernel import (  # noqa: E402
    GROUP, MEMORY_REGISTERS, Int4Tiles, _swizzled, as_int4, multiply_step, sm_count)
from strata_jax.ops.pool import ExpertPool  # noqa: E402

WGS = 2  # compute warpgroups, 64 rows each
COMPUTE_REGISTERS = 232  # (512 - 40) / 2, rounded down to 8: what Pallas' own split asks


def down_ranges(n_valid, ctas: int, blocks1: int, k1: int, blocks2: int, k2: int,
                balanced: bool = True):
    """[2, P] int32: the down tiles [lo, hi) of each CTA (entry-major tile order).

    A CTA takes gate/up tiles p, p + P, ... (2 weight tiles x k1 steps each), so the first
    `total1 % P` CTAs have one more, and a gate/up tile weighs as much as several down tiles.
    Round-robin shares: the down tiles split as evenly as they go. `balanced`: the down tiles
    also fill each CTA up to the same total of weight bytes (the CTAs with fewer gate/up tiles,
    done first, taking the first entries' down tiles), where that lowers the largest total."""
    p = jnp.arange(ctas)
    total1, total2 = n_valid[0] * blocks1, n_valid[0] * blocks2
    load = (jnp.maximum(total1 - p + ctas - 1, 0) // ctas) * (2 * k1)  # in weight-tile steps
    n2 = jnp.maximum(total2 - p + ctas - 1, 0) // ctas
    even = jnp.stack([jnp.cumsum(n2) - n2, jnp.cumsum(n2)]).astype(jnp.int32)
    if not balanced:
        return even
    order = jnp.argsort(load, stable=True)  # fewest gate/up steps first
    target = (jnp.sum(load) + total2 * k2) / ctas
    want = jnp.maximum(target - load[order], 0) / k2
    bounds = jnp.clip(jnp.round(jnp.cumsum(want)), 0, total2).astype(jnp.int32)
    bounds = bounds.at[-1].set(total2)  # every down tile taken
    lo = jnp.concatenate([jnp.zeros(1, jnp.int32), bounds[:-1]])
    filled = jnp.zeros((2, ctas), jnp.int32).at[0, order].set(lo).at[1, order].set(bounds)

    def peak(ranges):
        return jnp.max(load + (ranges[1] - ranges[0]) * k2)
    return jnp.where(peak(filled) < peak(even), filled, even)


def fused_ws_swiglu_int4(x, slots, pool: ExpertPool, valid=None, stages: int = 4,
                         groups: int = 2, balanced: bool = True):
    """Partial sums [C, 1, N, D] float32 (`grouped_swiglu_int4`'s contract) in one launch.
    `pool` tile-major by (128, 128 * groups); `balanced`: see `down_ranges`."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    d, f = x.shape[-1], pool.intermediate_size
    bo, bk = 64 * WGS, GROUP * groups
    assert pool.tile == (bo, bk), (pool.tile, (bo, bk))
    up_tiles = Int4Tiles(64, stages, groups, fold_lag=0)
    down_tiles = dataclasses.replace(up_tiles, f16=False)
    xp, x_scale, valid, order, n_valid, n0, r = fused_inputs(x, valid, slots.shape[0])
    c_n = slots.shape[0]
    blocks1, blocks2, k1, k2 = f // bo, d // bo, d // bk, f // bk
    ctas = sm_count()
    shared_x = xp.shape[0] == 1
    s = stages

    def body(order_ref, n_ref, slots_ref, x_scale_ref, ranges_ref, x_gmem, w1, s1, w3, s3, w2,
             s2, y_gmem, h_gmem, xs, hs, wa, sa, wb, sb, o1, o2, loaded1, loaded2, consumed):
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((c_n,)))
        p, wg = lax.axis_index("p"), lax.axis_index("wg")

        def tile_at(t, blocks):  # entry, its slot, row block of a phase's tile t
            entry = order_ref[lax.div(t, blocks)]
            return entry, slots_ref[entry], lax.rem(t, blocks)

        def at1(g):  # gate/up step g: tiles p, p + P, ...
            return (*tile_at(p + lax.div(g, k1) * ctas, blocks1), lax.rem(g, k1))

        lo2 = ranges_ref[p]  # ranges flattened: [lo..., hi...]

        def at2(g):  # down step g: tiles lo2, lo2 + 1, ...
            return (*tile_at(lo2 + lax.div(g, k2), blocks2), lax.rem(g, k2))

        steps1 = lax.div(jnp.maximum(n_ref[0] * blocks1 - p + ctas - 1, 0), ctas) * k1
        steps2 = (ranges_ref[ctas + p] - lo2) * k2

        @pl.when(wg == WGS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            def issue(g, carry):
                slot = lax.rem(g, s)
                pl.when(g >= s)(lambda: plgpu.barrier_wait(consumed.at[slot]))

                @pl.when(g < steps1)
                def _():
                    entry, slot_e, block, kk = at1(g)
                    row = 0 if shared_x else entry * r
                    plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(row, r), pl.ds(kk * bk, bk)],
                                            xs.at[slot], loaded1.at[slot])
                    tile = ((slot_e * blocks1 + block) * k1 + kk) * bo
                    srow = (slot_e * k1 + kk) * groups
                    for w, sc, wd, sd in ((w1, s1, wa, sa), (w3, s3, wb, sb)):
                        plgpu.copy_gmem_to_smem(w.at[pl.ds(tile, bo)], wd.at[slot],
                                                loaded1.at[slot])
                        plgpu.copy_gmem_to_smem(sc.at[pl.ds(srow, groups), pl.ds(block * bo, bo)],
                                                sd.at[slot], loaded1.at[slot])

                @pl.when(g >= steps1)
                def _():
                    entry, slot_e, block, kk = at2(g - steps1)
                    tile = ((slot_e * blocks2 + block) * k2 + kk) * bo
                    srow = (slot_e * k2 + kk) * groups
                    plgpu.copy_gmem_to_smem(w2.at[pl.ds(tile, bo)], wa.at[slot],
                                            loaded2.at[slot])
                    plgpu.copy_gmem_to_smem(s2.at[pl.ds(srow, groups), pl.ds(block * bo, bo)],
                                            sa.at[slot], loaded2.at[slot])
                    # the entry's h is complete (every gate/up tile's two halves stored)
                    pl.when(kk == 0)(lambda: pl.semaphore_wait(
                        sems.at[entry], blocks1 * WGS, decrement=False))
                    plgpu.copy_gmem_to_smem(h_gmem.at[pl.ds(entry * f + kk * bk, bk)],
                                            hs.at[slot], loaded2.at[slot])
                return carry

            lax.fori_loop(0, steps1 + steps2, issue, None)

        def own(slot, *pairs):  # this warpgroup's rows of the slot's weight tiles and scales
            rows = pl.ds(wg * 64, 64)
            return [a for w, sc in pairs for a in (w.at[slot].at[rows], sc.at[slot].at[:, rows])]

        def finish1(g, accs):  # this warpgroup's 64 rows of h; the entry counts them
            entry, _, block, _ = at1(g)
            hand_over_h(accs, x_scale_ref[0], o1.at[wg],
                        h_gmem.at[pl.ds(entry * f + block * bo + wg * 64, 64)], sems.at[entry])

        def finish2(g, acc):
            entry, _, block, _ = at2(g)
            y = acc[...]
            acc[...] = plgpu.layout_cast(jnp.zeros(y.shape, y.dtype), plgpu.Layout.WGMMA)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o2[wg] = y
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o2.at[wg], y_gmem.at[pl.ds(entry * d + block * bo + wg * 64,
                                                                 64)])

        @pl.when(wg < WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

            def scoped(a1, a3, t1, t2):
                def step(g, carry):
                    slot = lax.rem(g, s)

                    @pl.when(g < steps1)
                    def _():
                        plgpu.barrier_wait(loaded1.at[slot])
                        multiply_step(lambda gg: xs.at[slot].at[:, pl.ds(gg * GROUP, GROUP)].T,
                                      own(slot, (wa, sa), (wb, sb)), (a1, a3), (t1, t2),
                                      up_tiles)
                        plgpu.barrier_arrive(consumed.at[slot])
                        pl.when(lax.rem(g, k1) == k1 - 1)(lambda: finish1(g, (a1, a3)))

                    @pl.when(g >= steps1)
                    def _():
                        plgpu.barrier_wait(loaded2.at[slot])
                        multiply_step(lambda gg: hs.at[slot].at[pl.ds(gg * GROUP, GROUP)],
                                      own(slot, (wa, sa)), (a1,), (t1, t2), down_tiles)
                        plgpu.barrier_arrive(consumed.at[slot])
                        g2 = g - steps1
                        pl.when(lax.rem(g2, k2) == k2 - 1)(lambda: finish2(g2, a1))
                    return carry

                lax.fori_loop(0, steps1 + steps2, step, None)

            pl.run_scoped(scoped, *[plgpu.ACC((64, r)) for _ in range(4)])

        plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM((s, r, bk), jnp.float16, transforms=_swizzled(GROUP, 16)),
        plgpu.SMEM((s, bk, r), jnp.bfloat16, transforms=_swizzled(r, 16)),
        plgpu.SMEM((s, bo, bk), jnp.int4, transforms=_swizzled(GROUP, 4)),
        plgpu.SMEM((s, groups, bo), jnp.bfloat16),
        plgpu.SMEM((s, bo, bk), jnp.int4, transforms=_swizzled(GROUP, 4)),
        plgpu.SMEM((s, groups, bo), jnp.bfloat16),
        plgpu.SMEM((WGS, 64, r), jnp.bfloat16),
        plgpu.SMEM((WGS, 64, r), jnp.float32),
        plgpu.Barrier(num_arrivals=5, num_barriers=s),
        plgpu.Barrier(num_arrivals=3, num_barriers=s),
        plgpu.Barrier(num_arrivals=WGS, num_barriers=s),
    ]
    kernel = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((c_n * d, r), jnp.float32),
                        jax.ShapeDtypeStruct((c_n * f, r), jnp.bfloat16)),
        scratch_types=scratch, grid=(ctas,), grid_names=("p",), num_threads=WGS + 1,
        thread_name="wg", kernel_name="int4_fused_ws",
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True))
    weights = [a for w, sc in ((pool.w1, pool.w1_scale), (pool.w3, pool.w3_scale),
                               (pool.w2, pool.w2_scale))
               for a in (as_int4(w).reshape(-1, bk), sc.reshape(-1, sc.shape[-1]))]
    ranges = down_ranges(n_valid, ctas, blocks1, k1, blocks2, k2, balanced)
    y, _ = kernel(order.astype(jnp.int32), n_valid, slots.astype(jnp.int32), x_scale,
                  ranges.reshape(-1),
                  xp.reshape(-1, d), *weights)
    y = jnp.where(valid[:, None, None], y.reshape(c_n, d, r), 0.0)
    return jnp.swapaxes(y, 1, 2)[:, None, :n0]


def tiled(pool: ExpertPool, groups: int = 2) -> ExpertPool:
    return pool.tiled_by(64 * WGS, GROUP * groups)


def lower() -> None:
    """Lower for CUDA on any machine (Qwen3 shapes, 64 entries x 8 rows)."""
    d, f, c = 2048, 768, 64
    sds = jax.ShapeDtypeStruct
    bo, bk = 64 * WGS, 2 * GROUP
    u8 = lambda *sh: sds(sh, jnp.uint8)  # noqa: E731
    bf = lambda *sh: sds(sh, jnp.bfloat16)  # noqa: E731
    pool = ExpertPool(u8(c, f // bo, d // bk, bo, bk // 2), u8(c, f // bo, d // bk, bo, bk // 2),
                      u8(c, d // bo, f // bk, bo, bk // 2), bf(c, d // 128, f),
                      bf(c, d // 128, f), bf(c, f // 128, d))
    jax.jit(functools.partial(fused_ws_swiglu_int4)).trace(
        bf(8, d), sds((c,), jnp.int32), pool, sds((c,), jnp.bool_)).lower(
        lowering_platforms=("cuda",))


def main() -> None:
    from benchmarks.common import hbm_bandwidth
    from benchmarks.int4_experts import int4_expert_bytes, random_int4_pool
    from strata_jax.ops import expert_kernels as ek
    from strata_jax.ops import int4_kernel

    bound = hbm_bandwidth()["read"]
    for name, (d, f, entries, active, rows, layers) in {
            "qwen3": (2048, 768, 64, 51, 8, 16), "mixtral": (4096, 14336, 8, 8, 16, 8)}.items():
        pool = random_int4_pool(jax.random.PRNGKey(1), entries * layers, d, f)
        pool_t = tiled(pool)
        xs = [jax.random.normal(jax.random.PRNGKey(k), (rows, d), jnp.bfloat16) for k in (2, 3)]
        slots = jnp.arange(entries * layers, dtype=jnp.int32).reshape(layers, entries)
        valid = jnp.arange(entries) < active
        wants = [ek.grouped_swiglu_xla(x, slots[0], pool, valid).sum(1) for x in xs]
        nbytes = active * int4_expert_bytes(d, f)
        two = int4_kernel.tiles_for(d, f)
        variants = {
            f"two kernels {two}": (lambda x, sl, p: int4_kernel.grouped_swiglu_int4(
                x, sl, p, valid, two), int4_kernel.weight_tile(two)),
            **{f"fused ws, {st} stages{'' if bal else ', round-robin down'}": (functools.partial(
                lambda x, sl, p, st, bal: fused_ws_swiglu_int4(x, sl, p, valid, stages=st,
                                                               balanced=bal), st=st, bal=bal),
                (64 * WGS, 2 * GROUP)) for st, bal in ((4, True), (3, True), (4, False))},
        }
        for label, (fn, tile) in variants.items():
            p = pool.tiled_by(*tile) if tile != pool_t.tile else pool_t

            @jax.jit
            def run(x, p, fn=fn):  # a scan over the layers: the kernel compiles once
                return lax.scan(lambda c, sl: (c, fn(x, sl, p).sum(1)), 0, slots)[1]
            report(f"{name} {label}", lambda x, p=p, run=run: run(x, p)[0], xs, wants, nbytes,
                   bound, per=layers)

if __name__ == "__main__":
    main()
