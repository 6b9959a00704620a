"""Grouped SwiGLU over packed int4 pool slots on Hopper: a Pallas Mosaic GPU kernel.

Each CTA owns `rows` output features of one active slot and streams that slot's int4 tiles
(K-contiguous, the pool's own bytes seen as `int4 [S, out, in]`) through a TMA pipeline. Each
128-input group is converted to bf16 in registers (exact: small ints) and fed to wgmma as the A
operand, out^T [rows, R] = q_tile [rows, 128] @ x^T [128, R], into one of two alternating
accumulators; the group's scales then multiply that [rows, R] result into the running sum, so
the weights are never rescaled element by element and never round-trip through shared memory.
The sum is sum_g scale_g * (q_g @ x_g): the dequantized weights' product without rounding
q * scale to bf16 first (the XLA path rounds it; both agree to bf16 accuracy).
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
    """Output features per CTA tile (a multiple of 64, one wgmma M), TMA steps in flight, scale
    groups (128 inputs each) per pipeline step, persistent CTAs per SM (0: one CTA per tile),
    and the parts the gate/up and the down projections' reductions are split into (summed in
    float32 after; a split gate/up leaves SiLU(gate) * up to XLA). Splits make more, shorter
    tiles: fewer CTAs idle in the last wave when few experts are active. `fold_lag`: groups a
    wgmma result waits before it is folded into its running sum (1: the next group's wgmma
    runs meanwhile; 0: folded at once, so only one group's converted weights are live, which
    saves ~30 registers per thread: more CTAs per SM). `biased`: convert each weight pair to
    bf16 q + 136 (a prmt and a lop3, without the final subtraction) and take 136 * sum(x) of the
    group out of its wgmma result instead (per-group activation sums are one more input)."""

    rows: int = 64
    stages: int = 4
    groups: int = 1
    ctas_per_sm: int = 0
    down_splits: int = 1
    up_splits: int = 1
    fold_lag: int = 1
    biased: bool = False


INT4_TILES = Int4Tiles(rows=64, stages=2, groups=2)
# the fastest measured per expert shape (D, F) on the H200: benchmarks/results/int4_experts.md
TUNED_TILES = {
    (4096, 14336): Int4Tiles(64, 2, 2, down_splits=2),  # Mixtral-8x7B
    (2048, 768): Int4Tiles(64, 2, 2, ctas_per_sm=4, up_splits=2),  # Qwen3-30B-A3B
}


def is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def fits(d: int, f: int, tiles: Int4Tiles = INT4_TILES) -> bool:
    """Whether expert dims D, F tile: both are reduction dims (whole steps, D's in `up_splits`
    and F's in `down_splits` equal parts) and output dims."""
    step = GROUP * tiles.groups
    return (tiles.fold_lag in (0, 1) and all(k % step == 0 and k % tiles.rows == 0 for k in (d, f))
            and (d // step) % tiles.up_splits == 0 and (f // step) % tiles.down_splits == 0)


def tiles_for(d: int, f: int, base: Int4Tiles | None = None) -> Int4Tiles | None:
    """`base` (default: `TUNED_TILES` for the shape, else `INT4_TILES`), or `base` with one
    group per step and/or unsplit projections where those do not divide D or F, or None."""
    base = base or TUNED_TILES.get((d, f), INT4_TILES)
    for groups, split in itertools.product((base.groups, 1), (True, False)):
        tiles = dataclasses.replace(base, groups=groups,
                                    up_splits=base.up_splits if split else 1,
                                    down_splits=base.down_splits if split else 1)
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


def permute_k(x: jax.Array) -> jax.Array:
    """The input order the kernel's weights arrive in: within each block of 32 inputs, input
    8c + 2a + b moves to 8a + 2c + b (an involution). See `_as_wgmma_bf16`."""
    *lead, k = x.shape
    return x.reshape(*lead, k // 32, 4, 4, 2).swapaxes(-3, -2).reshape(*lead, k)


BIAS = 136.0  # `biased` conversion: q + BIAS, exact in bf16 (128 + the sign-flipped nibble)


def _as_wgmma_bf16(w, biased: bool = False):
    """An int4 tile [rows, 128] loaded in Mosaic's UPCAST_4X layout -> bf16 in the WGMMA
    register layout, with no data moved between threads.

    Both layouts give a thread the same rows; in each block of 32 inputs UPCAST_4X gives it the
    8 consecutive inputs 8c..8c+7 (c = lane % 4), WGMMA the pairs 8a + 2c + {0, 1} (a < 4). So
    the thread's 32-bit word is read as its 4 WGMMA pairs as is, which multiplies by the inputs
    in `permute_k` order: the activations are permuted instead of shuffling the weights
    (Mosaic's own relayout costs two warp shuffles per word). The ints convert exactly.
    `biased`: q + BIAS per value, Mosaic's conversion without its subtraction."""
    import numpy as np
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
        return_type=plgpu.ShapeDtypeStruct(w.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def view(_, words):
        shape = mgpu.WGMMA_LAYOUT.registers_shape(words.shape)
        assert shape[1] == 4 * words.registers.shape[1], (shape, words.registers.shape)
        pairs = np.empty(shape, dtype=object)
        i32 = ir.IntegerType.get_signless(32)
        for (i, j, *rest), word in np.ndenumerate(words.registers):
            if biased:
                bits = mgpu_utils.bitcast(word, i32)
                high = arith.shrui(bits, arith.constant(i32, 4))
            for a in range(4):
                if biased:  # nibbles 2a, 2a + 1 into the low bits of each half, then | 0x4300
                    pair = llvm.inline_asm(  # and flip the sign bit: 136 + q
                        i32, [bits, high],
                        f"{{ .reg .b32 t; prmt.b32 t, $1, $2, 0xF{a + 4}F{a}; "
                        "lop3.b32 $0, t, 0x000F000F, 0x43084308, 0x6a; }", "=r,r,r")
                    pair = mgpu_utils.bitcast(pair, ir.VectorType.get((2,), ir.BF16Type.get()))
                else:
                    pair = mgpu_utils.vector_slice(word, slice(2 * a, 2 * a + 2))
                pairs[(i, 4 * j + a, *rest)] = pair
        if biased:
            return mgpu.FragmentedArray(_registers=pairs, _layout=mgpu.WGMMA_LAYOUT,
                                        _is_signed=None)
        ints = mgpu.FragmentedArray(_registers=pairs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=True)
        return ints.astype(ir.BF16Type.get())

    return view(w)


def sm_count() -> int:
    """Streaming multiprocessors of the first device (132 on an H100/H200, the fallback)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def int4_matmul_t(x, order, n_valid, slots, weights, tiles: Int4Tiles = INT4_TILES,
                  epilogue=None, out_dtype=None, splits: int = 1, name: str = "int4_matmul"):
    """out^T [splits, C, n, O, R]: epilogue(W_1[slot_c] @ x[c]^T, ...) (n = 1), or without an
    epilogue the n = len(weights) products, for the first `n_valid` entries c of `order` (the
    others are left unwritten), each reduction split in `splits`.

    x bf16 [C, R, K] (or [1, R, K] shared by all entries); weights: tuple of (int4 [S, O, K],
    bf16 scales [S, K / GROUP, O]). A tile is `rows` output features of one entry and split;
    CTA p streams tiles p, p + P, ... through one TMA pipeline, so with a persistent grid
    (`ctas_per_sm`) the next tile's loads overlap this tile's last steps."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    c_n, (_, r, k) = slots.shape[0], x.shape
    o, nw, bo = weights[0][0].shape[1], len(weights), tiles.rows
    bk = GROUP * tiles.groups
    k_steps, blocks = k // bk // splits, o // bo
    per_entry = blocks * splits
    ctas = c_n * per_entry
    if tiles.ctas_per_sm:
        ctas = min(ctas, sm_count() * tiles.ctas_per_sm)
    out_dtype = out_dtype or x.dtype
    n_out = 1 if epilogue else nw
    epilogue = epilogue or (lambda *accs: accs)
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    shared_x = x.shape[0] == 1
    n_in = 2 * nw + tiles.biased  # weights and scales, and the activations' group sums
    sums_width = -(-r // 32) * 32  # TMA copies whole 128-byte rows: the sums are padded

    persistent = tiles.ctas_per_sm > 0

    def body(order_ref, n_ref, slots_ref, x_gmem, *refs):
        in_gmem, (out_gmem, o_smem) = refs[:n_in], refs[n_in:]
        p = lax.axis_index("p")
        total = n_ref[0] * per_entry

        def tile_at(t):  # entry, its slot, row block, split of tile t
            entry = order_ref[lax.div(t, per_entry)]
            rest = lax.rem(t, per_entry)
            return entry, slots_ref[entry], lax.div(rest, splits), lax.rem(rest, splits)

        if persistent:  # tiles p, p + P, ...: read at each step's index maps
            mine = lax.div(jnp.maximum(total - p + ctas - 1, 0), ctas)

            def tile(i):
                return tile_at(p + i * ctas)
        else:  # one tile: read once, and a static pipeline grid
            mine, fixed = 1, tile_at(p)

            def tile(_):
                return fixed

        def x_index(i, kk):
            entry, _, _, split = tile(i)
            return (0 if shared_x else entry), split * k_steps + kk

        def w_index(i, kk):
            _, slot, block, split = tile(i)
            return slot * blocks + block, split * k_steps + kk

        def s_index(i, kk):
            _, slot, block, split = tile(i)
            return slot * (k // bk) + split * k_steps + kk, block

        def sums_index(i, kk):
            entry, _, _, split = tile(i)
            return (0 if shared_x else entry) * (k // bk) + split * k_steps + kk, 0

        def fold(temp, scale, sums, acc, wait_n):
            # acc += scale[row] * (a group's q @ x^T), once its wgmma is done
            part = plgpu.wgmma_accumulator_load(temp, wait_n=wait_n)
            if sums is not None:  # the wgmma multiplied q + BIAS
                part = part - BIAS * lax.broadcast_in_dim(sums, part.shape, [1])
            acc[...] = (plgpu.wgmma_accumulator_load(acc, wait_n=None)
                        + part * lax.broadcast_in_dim(scale, part.shape, [0]))

        def units(weight_smem, accs):
            """Per scale group and weight: its bf16 tile [rows, 128], its scales' smem, the
            group, the weight's running sum."""
            weights_accs = list(zip(weight_smem[::2], weight_smem[1::2], accs, strict=True))
            for g, (w_smem, s_smem, acc) in itertools.product(range(tiles.groups), weights_accs):
                w = plgpu.load(w_smem.at[:, pl.ds(g * GROUP, GROUP)], (),
                               layout=plgpu.Layout.WGMMA_UPCAST_4X)
                yield _as_wgmma_bf16(w, tiles.biased), s_smem, g, acc

        def finish(i, accs):  # the tile's epilogue and its TMA store
            entry, _, block, split = tile(i)
            results = epilogue(*(acc[...] for acc in accs))
            results = results if isinstance(results, tuple) else (results,)
            for acc in accs:
                acc[...] = plgpu.layout_cast(jnp.zeros(acc.shape, acc.dtype),
                                             plgpu.Layout.WGMMA)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store read
            for j, result in enumerate(results):
                o_smem[j] = result.astype(out_dtype)
            plgpu.commit_smem()
            for j in range(n_out):
                row = (((split * c_n + entry) * n_out + j) * blocks + block) * bo
                plgpu.copy_smem_to_gmem(o_smem.at[j], out_gmem.at[pl.ds(row, bo)])

        def step(idx, x_smem, *in_smem, accs, temps):
            """Each group's wgmma into one of two temporaries, folded into its running sum
            while the next group's runs (`fold_lag=1`) or as soon as it is done (0)."""
            weight_smem, sums_smem = in_smem[: 2 * nw], in_smem[2 * nw:]
            zero = plgpu.layout_cast(jnp.zeros((bo, r), jnp.float32), plgpu.Layout.WGMMA)
            pending = None
            for i, (w, s_smem, g, acc) in enumerate(units(weight_smem, accs)):
                temps[i % 2][...] = zero
                plgpu.wgmma(temps[i % 2], w, x_smem.at[:, pl.ds(g * GROUP, GROUP)].T)
                scale = plgpu.load(s_smem.at[g], (), layout=row_layout).astype(jnp.float32)
                sums = (plgpu.load(sums_smem[0].at[g, pl.ds(0, r)], (), layout=col_layout)
                        if tiles.biased else None)
                if not tiles.fold_lag:
                    fold(temps[i % 2], scale, sums, acc, wait_n=0)
                    continue
                if pending is not None:  # the previous group's wgmma, while this one runs
                    fold(*pending, wait_n=1)
                pending = (temps[i % 2], scale, sums, acc)
            # Waiting here keeps the kernel free of automatic barriers: no wgmma still reads a
            # buffer the pipeline refills after this step.
            if pending is not None:
                fold(*pending, wait_n=0)
            pl.when(idx[1] == k_steps - 1)(lambda: finish(idx[0], accs))

        def run(*refs):
            accs, temps = refs[:nw], refs[nw:]
            # swizzles sized for one group, so that each group's columns are whole tiles
            specs = [plgpu.BlockSpec((r, bk), x_index, transforms=_swizzled(GROUP, 16))]
            for _ in range(nw):
                specs += [plgpu.BlockSpec((bo, bk), w_index, transforms=_swizzled(GROUP, 4)),
                          plgpu.BlockSpec((tiles.groups, bo), s_index)]
            if tiles.biased:
                specs.append(plgpu.BlockSpec((tiles.groups, sums_width), sums_index))
            plgpu.emit_pipeline(functools.partial(step, accs=accs, temps=temps),
                                grid=(mine, k_steps), in_specs=specs,
                                max_concurrent_steps=tiles.stages)(x_gmem, *in_gmem)

        # nw running sums, and two accumulators that the groups' wgmmas alternate between
        @pl.when(persistent or p < total)
        def _():
            pl.run_scoped(run, *[plgpu.ACC((bo, r)) for _ in range(nw + 2)])

        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((splits * c_n * n_out * o, r), out_dtype),
        scratch_types=[plgpu.SMEM((n_out, bo, r), out_dtype)],
        grid=(ctas,), grid_names=("p",), kernel_name=name,
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True))
    # 2-D views (free reshapes): rows of x by entry, weight rows by slot, scale rows by slot
    args = [a for w, s in weights for a in (w.reshape(-1, k), s.reshape(-1, o))]
    if tiles.biased:  # each entry's activations summed per group: [C * K / GROUP, R'] float32
        sums = x.astype(jnp.float32).reshape(x.shape[0], r, k // GROUP, GROUP).sum(-1)
        sums = jnp.pad(jnp.swapaxes(sums, 1, 2), ((0, 0), (0, 0), (0, sums_width - r)))
        args.append(sums.reshape(-1, sums_width))
    out = kernel(order.astype(jnp.int32), jnp.reshape(n_valid, (1,)).astype(jnp.int32),
                 slots.astype(jnp.int32), x.reshape(-1, k), *args)
    return out.reshape(splits, c_n, n_out, o, r)


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
    xp = permute_k(jnp.pad(x3, ((0, 0), (0, n - n0), (0, 0))))
    valid = jnp.ones(slots.shape, bool) if valid is None else valid != 0
    order = jnp.argsort(~valid, stable=True)  # valid entries first; the kernel skips the rest
    n_valid = jnp.sum(valid, dtype=jnp.int32)
    gate_up = ((as_int4(pool.w1), pool.w1_scale), (as_int4(pool.w3), pool.w3_scale))
    if tiles.up_splits == 1:
        h_t = int4_matmul_t(xp, order, n_valid, slots, gate_up, tiles,
                            epilogue=lambda a1, a3: jax.nn.silu(a1) * a3,
                            name="int4_gate_up")[0, :, 0]
    else:
        parts = int4_matmul_t(xp, order, n_valid, slots, gate_up, tiles, out_dtype=jnp.float32,
                              splits=tiles.up_splits, name="int4_gate_up").sum(0)
        h_t = (jax.nn.silu(parts[:, 0]) * parts[:, 1]).astype(x.dtype)
    h = permute_k(jnp.swapaxes(h_t, 1, 2))  # [C, n, F]: a few MB, fused into one XLA transpose
    y_t = int4_matmul_t(h, order, n_valid, slots, ((as_int4(pool.w2), pool.w2_scale),), tiles,
                        out_dtype=jnp.float32, splits=tiles.down_splits, name="int4_down")
    y = jnp.where(valid[:, None, None], jnp.sum(y_t[:, :, 0], axis=0), 0.0)  # invalid: unwritten
    return jnp.swapaxes(y, 1, 2)[:, None, :n0]
