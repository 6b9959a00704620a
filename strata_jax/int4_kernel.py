"""Grouped SwiGLU over packed int4 pool slots on Hopper: a Pallas Mosaic GPU kernel.

Each CTA owns `rows` output features of one active slot and streams that slot's int4 tiles
(K-contiguous, the pool's own bytes seen as `int4 [S, out, in]`) through a TMA pipeline. The
tiles are dequantized in registers, bf16(q * scale) exactly as `pool.dense_weights` computes
them, and fed to wgmma as the A operand: out^T [rows, R] = W_tile [rows, K] @ x^T [K, R], so
the dequantized weights never round-trip through shared memory (the bound of the Triton
kernel, see docs/quantization.md).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from strata_jax.pool import ExpertPool
from strata_jax.quant import GROUP

ROW_MULTIPLE = 8  # wgmma N (the activation rows) comes in multiples of 8


@dataclass(frozen=True)
class Int4Tiles:
    """Output features per CTA (a multiple of 64, one wgmma M), TMA steps in flight, and scale
    groups (128 inputs each) per pipeline step."""

    rows: int = 64
    stages: int = 4
    groups: int = 1


# the best of the sweep in benchmarks/results/int4_experts.md (Qwen3 and 16-token Mixtral; within
# noise of the best for 32-token Mixtral)
INT4_TILES = Int4Tiles(rows=64, stages=3, groups=2)


def is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def fits(d: int, f: int, tiles: Int4Tiles = INT4_TILES) -> bool:
    """Whether expert dims D, F tile: both are reduction dims (whole steps) and output dims."""
    return all(k % (GROUP * tiles.groups) == 0 and k % tiles.rows == 0 for k in (d, f))


def tiles_for(d: int, f: int, base: Int4Tiles = INT4_TILES) -> Int4Tiles | None:
    """`base`, or `base` with one group per step where two do not divide D or F, or None."""
    for tiles in (base, dataclasses.replace(base, groups=1)):
        if fits(d, f, tiles):
            return tiles
    return None


def as_int4(packed: jax.Array) -> jax.Array:
    """uint8 [..., out, in/2] -> int4 [..., out, in]: the same bytes (a bitcast inside a jit)."""
    *lead, o, half = packed.shape
    return lax.bitcast_convert_type(packed, jnp.int4).reshape(*lead, o, 2 * half)


def _swizzled(minor_elems: int, bits: int) -> tuple:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = plgpu.find_swizzle(minor_elems * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def int4_matmul_t(x, slots, valid, weights, tiles: Int4Tiles = INT4_TILES, epilogue=None,
                  out_dtype=None, name: str = "int4_matmul"):
    """out^T [C, O, R] = epilogue(W_1[slot_c] @ x[c]^T, ...) for each entry c.

    x bf16 [C, R, K] (or [1, R, K] shared by all entries); weights: tuple of (int4 [S, O, K],
    bf16 scales [S, K / GROUP, O]); entries whose `valid` is 0 read nothing and give zeros."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    c_n, (_, r, k) = slots.shape[0], x.shape
    o, nw, bo = weights[0][0].shape[1], len(weights), tiles.rows
    bk = GROUP * tiles.groups
    out_dtype = out_dtype or x.dtype
    epilogue = epilogue or (lambda acc: acc)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def body(slots_ref, valid_ref, x_gmem, *refs):
        w_gmem, (out_gmem, o_smem) = refs[: 2 * nw], refs[2 * nw:]
        c, j = lax.axis_index("c"), lax.axis_index("o")
        slot = slots_ref[c]

        def step(_, x_smem, *weight_smem, accs):
            pairs = list(zip(weight_smem[::2], weight_smem[1::2], accs, strict=True))
            for g, (w_smem, s_smem, acc) in itertools.product(range(tiles.groups), pairs):
                cols = pl.ds(g * GROUP, GROUP)
                w = plgpu.load(w_smem.at[:, cols], (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
                w = plgpu.layout_cast(w, plgpu.Layout.WGMMA).astype(jnp.bfloat16)
                scale = plgpu.load(s_smem.at[g], (), layout=row_layout)
                w = w * lax.broadcast_in_dim(scale, w.shape, [0])
                plgpu.wgmma(acc, w, x_smem.at[:, cols].T)
            # Waiting here keeps the kernel free of automatic barriers: every warp's reads of
            # this step's buffers precede its wgmma, so none is pending when a slot is refilled.
            plgpu.wgmma_wait(0)

        def run(*accs):
            # swizzles sized for one group, so that each group's columns are whole tiles
            specs = [plgpu.BlockSpec((r, bk), lambda kk: (0, kk),
                                     transforms=_swizzled(GROUP, 16))]
            for _ in range(nw):
                specs += [plgpu.BlockSpec((bo, bk), lambda kk: (j, kk),
                                          transforms=_swizzled(GROUP, 4)),
                          plgpu.BlockSpec((tiles.groups, bo), lambda kk: (kk, j))]
            gmem = [x_gmem.at[c if x.shape[0] > 1 else 0]] + [w.at[slot] for w in w_gmem]
            plgpu.emit_pipeline(functools.partial(step, accs=accs), grid=(k // bk,),
                                in_specs=specs, max_concurrent_steps=tiles.stages)(*gmem)
            return tuple(acc[...] for acc in accs)

        @pl.when(valid_ref[c] != 0)
        def _():
            accs = pl.run_scoped(run, *[plgpu.ACC((bo, r)) for _ in range(nw)])
            o_smem[...] = epilogue(*accs).astype(out_dtype)

        @pl.when(valid_ref[c] == 0)
        def _():
            o_smem[...] = jnp.zeros((bo, r), out_dtype)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[c, pl.ds(j * bo, bo)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((c_n, o, r), out_dtype),
        scratch_types=[plgpu.SMEM((bo, r), out_dtype)],
        grid=(c_n, o // bo), grid_names=("c", "o"), kernel_name=name,
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True))
    args = [a for pair in weights for a in pair]
    return kernel(slots.astype(jnp.int32), valid.astype(jnp.int32), x, *args)


@functools.partial(jax.jit, static_argnames=("tiles",))
def grouped_swiglu_int4(x, slots, pool: ExpertPool, valid=None, tiles: Int4Tiles | None = None):
    """Partial sums [C, 1, N, D] float32 for the active slots of an int4 pool (the contract of
    `expert_kernels.grouped_swiglu`); x bf16 [N, D] or [C, N, D] (each entry's own rows).
    `tiles` default: `tiles_for` the pool's expert dims."""
    tiles = tiles or tiles_for(x.shape[-1], pool.intermediate_size)
    if tiles is None or not fits(x.shape[-1], pool.intermediate_size, tiles):
        raise ValueError(f"int4 experts D={x.shape[-1]}, F={pool.intermediate_size} do not "
                         f"tile by {tiles or INT4_TILES}")
    x3 = x if x.ndim == 3 else x[None]
    n0 = x3.shape[1]
    n = -(-n0 // ROW_MULTIPLE) * ROW_MULTIPLE
    xp = jnp.pad(x3, ((0, 0), (0, n - n0), (0, 0)))
    valid = jnp.ones(slots.shape, jnp.int32) if valid is None else valid
    gate_up = ((as_int4(pool.w1), pool.w1_scale), (as_int4(pool.w3), pool.w3_scale))
    h_t = int4_matmul_t(xp, slots, valid, gate_up, tiles,
                        epilogue=lambda a1, a3: jax.nn.silu(a1) * a3, name="int4_gate_up")
    h = jnp.swapaxes(h_t, 1, 2)  # [C, n, F]: a few MB, cheaper than a transposed store
    y_t = int4_matmul_t(h, slots, valid, ((as_int4(pool.w2), pool.w2_scale),), tiles,
                        out_dtype=jnp.float32, name="int4_down")
    return jnp.swapaxes(y_t, 1, 2)[:, None, :n0]
