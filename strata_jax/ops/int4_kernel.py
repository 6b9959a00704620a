"""Grouped SwiGLU over packed int4 pool slots on Hopper: a Pallas Mosaic GPU kernel.

Each CTA owns `rows` output features of one active slot and streams that slot's int4 tiles
(K-contiguous, the pool's own bytes seen as `int4 [S, out, in]`) through a TMA pipeline. Each
128-input group is converted to float16 (or bfloat16) in registers (exact: small ints) and fed
to wgmma as the A operand, out^T [rows, R] = q_tile [rows, 128] @ x^T [128, R] (x scaled into
float16's range by a power of two, taken out again at the end), into one of two alternating
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

from strata_jax.formats.quant import GROUP
from strata_jax.ops.layers import ordered_sum
from strata_jax.ops.pool import ExpertPool

ROW_MULTIPLE = 8  # wgmma N (the activation rows) comes in multiples of 8


@dataclass(frozen=True)
class Int4Tiles:
    """Tiles of the Mosaic GPU grouped-SwiGLU kernel for int4 pools (`grouped_swiglu_int4`;
    a type of its own beside `expert_kernels.FloatTiles` and `int8_kernel.Int8Tiles`, which
    tile Triton kernels by other parameters).

    Output features per CTA tile (a multiple of 64, one wgmma M), TMA steps in flight, scale
    groups (128 inputs each) per pipeline step, persistent CTAs per SM (0: one CTA per tile),
    and the parts the gate/up and the down projections' reductions are split into (summed in
    float32 after; a split gate/up leaves SiLU(gate) * up to XLA). Splits make more, shorter
    tiles: fewer CTAs idle in the last wave when few experts are active. `fold_lag`: groups a
    wgmma result waits before it is folded into its running sum (1: the next group's wgmma
    runs meanwhile; 0: folded at once, so only one group's converted weights are live, which
    saves ~30 registers per thread: more CTAs per SM). `f16`: multiply in float16 (the
    activations scaled by a power of two into its range, exact: bfloat16 values have 8
    significant bits, float16 11; the scale is taken out of the result), so that each weight
    word converts with one shift and four lop3: float16's 10-bit mantissa holds a nibble at
    bits 4-7, bfloat16's 7 bits do not, which costs the bfloat16 conversion (`f16=False`) four
    more prmt per word, on the integer pipe that binds. `compute_wgs` > 1: a warp-specialized
    CTA, one warpgroup issuing the TMA loads and `compute_wgs` computing, each on `rows` (64) of
    a tile of `rows * compute_wgs` output features: the activations are loaded once for all of
    them (less L2 traffic per weight byte); one tile per CTA, or with `ctas_per_sm=1` one
    persistent CTA per SM. `stream_k`: the persistent CTAs take equal runs of the launch's
    pipeline steps, across tile boundaries, instead of whole tiles (no CTA idles while others
    finish a last tile); a tile cut between two CTAs is summed from their two parts after the
    kernel, head + tail, in that order (deterministic). `down`: the down kernel's own
    stages, persistence, stream-K, fold lag and split (None: these tiles'); its rows, groups,
    f16 and warpgroups must be these (one tile-major layout serves both kernels)."""

    rows: int = 64
    stages: int = 4
    groups: int = 1
    ctas_per_sm: int = 0
    down_splits: int = 1
    up_splits: int = 1
    fold_lag: int = 1
    f16: bool = True
    compute_wgs: int = 1
    stream_k: bool = False
    down: Int4Tiles | None = None


INT4_TILES = Int4Tiles(rows=64, stages=2, groups=2)
# the fastest measured per expert shape (D, F) on the H200: benchmarks/results/int4_experts.md
TUNED_TILES = {
    (4096, 14336): Int4Tiles(64, 2, 2),  # Mixtral-8x7B
    (2048, 768): Int4Tiles(64, 2, 2, ctas_per_sm=3, stream_k=True),  # Qwen3-30B-A3B
}


def is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


MEMORY_REGISTERS = 40  # per thread of a warp-specialized CTA's TMA warpgroup


def ws_registers_fit(compute_wgs: int) -> bool:
    """Whether Pallas' register split of a warp-specialized CTA fits what it is launched with.

    The CTA is compiled to take the whole register file, floor8(512 / warpgroups) per thread;
    the TMA warpgroup gives back to MEMORY_REGISTERS and each compute warpgroup asks for
    floor8((512 - MEMORY_REGISTERS) / compute_wgs) (`setmaxnreg`). If the asks exceed the
    launch allocation, `setmaxnreg.inc` waits forever: 4 compute warpgroups hang (488 > 480)."""
    launch = 512 // (compute_wgs + 1) // 8 * 8
    ask = min(256, (512 - MEMORY_REGISTERS) // compute_wgs) // 8 * 8
    return MEMORY_REGISTERS + compute_wgs * ask <= (compute_wgs + 1) * launch


SMEM_LIMIT = 227 * 1024  # shared memory one Hopper CTA may use
SMEM_SLACK = 2048  # barriers and alignment beside the buffers


def fitting_stages(tiles: Int4Tiles, rows: int, weights: int, out_bytes: int) -> int:
    """`tiles.stages`, or fewer where the pipeline's buffers at `rows` activation rows would
    not fit a CTA's shared memory (deep warp-specialized pipelines at 32 rows, say); 2 at
    least. `weights`: weight matrices per step; `out_bytes`: output bytes per element."""
    bk, bo = GROUP * tiles.groups, tiles.rows * tiles.compute_wgs
    stage = rows * bk * 2 + weights * (bo * bk // 2 + tiles.groups * bo * 2)
    room = SMEM_LIMIT - SMEM_SLACK - tiles.compute_wgs * tiles.rows * rows * out_bytes
    return max(2, min(tiles.stages, room // stage))


def down_tiles(tiles: Int4Tiles) -> Int4Tiles:
    """The tiles the down kernel runs with."""
    return tiles.down or tiles


def _kernel_ok(tiles: Int4Tiles, splits: int) -> bool:
    """Whether one kernel runs with these tiles, its reduction split in `splits`."""
    # a warp-specialized CTA takes the SM's registers: persistent, it is the SM's only CTA
    ws_ok = tiles.compute_wgs == 1 or (tiles.rows == 64 and tiles.ctas_per_sm <= 1
                                       and ws_registers_fit(tiles.compute_wgs))
    sk_ok = not tiles.stream_k or (tiles.compute_wgs == 1 and tiles.ctas_per_sm >= 1
                                   and splits == 1)
    return tiles.fold_lag in (0, 1) and tiles.compute_wgs >= 1 and ws_ok and sk_ok


def int4_fits(d: int, f: int, tiles: Int4Tiles = INT4_TILES) -> bool:
    """Whether expert dims D, F tile: both are reduction dims (whole steps, D's in `up_splits`
    and F's in the down kernel's `down_splits` equal parts) and output dims."""
    down = down_tiles(tiles)
    same = (down.rows, down.groups, down.f16, down.compute_wgs, down.down) == (
        tiles.rows, tiles.groups, tiles.f16, tiles.compute_wgs, None)
    step, block = GROUP * tiles.groups, tiles.rows * tiles.compute_wgs
    return (same and _kernel_ok(tiles, tiles.up_splits) and _kernel_ok(down, down.down_splits)
            and all(k % step == 0 and k % block == 0 for k in (d, f))
            and (d // step) % tiles.up_splits == 0 and (f // step) % down.down_splits == 0)


def _shaped(tiles: Int4Tiles, groups: int, split: bool) -> Int4Tiles:
    """`tiles` with `groups` per step, and unsplit unless `split`."""
    return dataclasses.replace(tiles, groups=groups, up_splits=tiles.up_splits if split else 1,
                               down_splits=tiles.down_splits if split else 1)


def int4_tiles_for(d: int, f: int, base: Int4Tiles | None = None) -> Int4Tiles | None:
    """`base` (default: `TUNED_TILES` for the shape, else `INT4_TILES`), or `base` with one
    group per step and/or unsplit projections where those do not divide D or F, or None."""
    base = base or TUNED_TILES.get((d, f), INT4_TILES)
    for groups, split in itertools.product((base.groups, 1), (True, False)):
        tiles = _shaped(base, groups, split)
        if base.down:
            tiles = dataclasses.replace(tiles, down=_shaped(base.down, groups, split))
        if int4_fits(d, f, tiles):
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


def permute_k(x: jax.Array, f16: bool = False) -> jax.Array:
    """The input order the kernel's weights arrive in (see `_as_wgmma`): within each block of
    32 inputs, input 8c + 2a + b moves to 8a + 2c + b (bf16 pairing, an involution), or with
    `f16`, input 8c + a + 4b moves to 8a + 2c + b."""
    *lead, k = x.shape
    if f16:  # [c, b, a] -> [a, c, b]
        return jnp.moveaxis(x.reshape(*lead, k // 32, 4, 2, 4), -1, -3).reshape(*lead, k)
    return x.reshape(*lead, k // 32, 4, 4, 2).swapaxes(-3, -2).reshape(*lead, k)


F16_LIMIT_EXP = 15  # activations are scaled below 2**15, inside float16's range (max 65504)


def as_f16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x (bfloat16) * 2**s as float16, and 2**-s (float32 [1]): s puts max |x| below 2**15.
    Exact: a power of two, and bfloat16's 8 significant bits fit float16's 11 (values more than
    2**29 below the largest one lose bits as float16 subnormals: far below the sum's rounding)."""
    _, e = jnp.frexp(jnp.max(jnp.abs(x)).astype(jnp.float32))
    s = jnp.clip(F16_LIMIT_EXP - e, -100, 100)
    return (x.astype(jnp.float32) * jnp.ldexp(1.0, s)).astype(jnp.float16), \
        jnp.ldexp(jnp.ones((1,), jnp.float32), -s)


def _as_wgmma(w, f16: bool = False):
    """An int4 tile [rows, 128] loaded in Mosaic's UPCAST_4X layout -> bf16 (or f16) in the
    WGMMA register layout, with no data moved between threads.

    Both layouts give a thread the same rows; in each block of 32 inputs UPCAST_4X gives it the
    8 consecutive inputs 8c..8c+7 (c = lane % 4), WGMMA the pairs 8a + 2c + {0, 1} (a < 4). So
    the thread's 32-bit word is read as its 4 WGMMA pairs in place, which multiplies by the
    inputs in `permute_k` order: the activations are permuted instead of shuffling the weights
    (Mosaic's own relayout costs two warp shuffles per word). bf16: pair a is nibbles 2a, 2a + 1
    (Mosaic's conversion: a prmt, a lop3 and a subtraction per pair). f16: pair a is nibbles a,
    a + 4, which lie in float16's mantissa as they are (a < 2) or after one shift of the word
    by 8 (a >= 2): a lop3 per pair makes 1024 + 16^(a % 2) * (q + 8), and one sub or fma gives
    q. The ints convert exactly either way."""
    import numpy as np
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
        return_type=plgpu.ShapeDtypeStruct(w.shape, jnp.float16 if f16 else jnp.bfloat16,
                                           layout=plgpu.Layout.WGMMA))
    def view(_, words):
        shape = mgpu.WGMMA_LAYOUT.registers_shape(words.shape)
        assert shape[1] == 4 * words.registers.shape[1], (shape, words.registers.shape)
        pairs = np.empty(shape, dtype=object)
        i32 = ir.IntegerType.get_signless(32)
        for (i, j, *rest), word in np.ndenumerate(words.registers):
            if f16:
                bits = mgpu_utils.bitcast(word, i32)
                high = arith.shrui(bits, arith.constant(i32, 8))
            for a in range(4):
                if f16:
                    pair = llvm.inline_asm(i32, [high if a >= 2 else bits], _F16_PAIR[a % 2],
                                           "=r,r")
                    pair = mgpu_utils.bitcast(pair, ir.VectorType.get((2,), ir.F16Type.get()))
                else:
                    pair = mgpu_utils.vector_slice(word, slice(2 * a, 2 * a + 2))
                pairs[(i, 4 * j + a, *rest)] = pair
        if f16:
            return mgpu.FragmentedArray(_registers=pairs, _layout=mgpu.WGMMA_LAYOUT,
                                        _is_signed=None)
        ints = mgpu.FragmentedArray(_registers=pairs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=True)
        return ints.astype(ir.BF16Type.get())

    return view(w)


# lop3 immLut 0x6a is (b ? a ^ c : c): the masked nibbles with their sign bit flipped (q + 8),
# under float16 1024.0 (0x6400); then - 1032 (0x6408), or * 1/16 (0x2C00) - 72 (0xD480)
_F16_PAIR = (
    "{ .reg .b32 t, c; lop3.b32 t, $1, 0x000F000F, 0x64086408, 0x6a; mov.b32 c, 0x64086408; "
    "sub.f16x2 $0, t, c; }",
    "{ .reg .b32 t, m, c; lop3.b32 t, $1, 0x00F000F0, 0x64806480, 0x6a; "
    "mov.b32 m, 0x2C002C00; mov.b32 c, 0xD480D480; fma.rn.f16x2 $0, t, m, c; }",
)


def sm_count() -> int:
    """Streaming multiprocessors of the first device (132 on an H100/H200, the fallback)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def _fold(temp, scale, acc, wait_n):
    """acc += scale[row] * (a group's q @ x^T), once its wgmma is done."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    part = plgpu.wgmma_accumulator_load(temp, wait_n=wait_n)
    acc[...] = (plgpu.wgmma_accumulator_load(acc, wait_n=None)
                + part * lax.broadcast_in_dim(scale, part.shape, [0]))


def _units(weight_smem, accs, tiles: Int4Tiles):
    """Per scale group and weight: its converted tile [rows, 128], its scales' smem, the group,
    the weight's running sum."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    weights_accs = list(zip(weight_smem[::2], weight_smem[1::2], accs, strict=True))
    for g, (w_smem, s_smem, acc) in itertools.product(range(tiles.groups), weights_accs):
        w = plgpu.load(w_smem.at[:, pl.ds(g * GROUP, GROUP)], (),
                       layout=plgpu.Layout.WGMMA_UPCAST_4X)
        yield _as_wgmma(w, tiles.f16), s_smem, g, acc


def multiply_step(operand, weight_smem, accs, temps, tiles: Int4Tiles) -> None:
    """One pipeline step of the int4 kernels: each group's wgmma (weights converted in
    registers, times `operand(g)`, the group's activations as the B operand [128, R]) into one of
    two temporaries, folded into its running sum while the next group's runs (`fold_lag=1`) or
    as soon as it is done (0). weight_smem: (int4 tile, scales) per weight; accs: their sums."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    zero = plgpu.layout_cast(jnp.zeros(temps[0].shape, jnp.float32), plgpu.Layout.WGMMA)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    pending = None
    for i, (w, s_smem, g, acc) in enumerate(_units(weight_smem, accs, tiles)):
        temps[i % 2][...] = zero
        plgpu.wgmma(temps[i % 2], w, operand(g))
        scale = plgpu.load(s_smem.at[g], (), layout=row_layout).astype(jnp.float32)
        if not tiles.fold_lag:
            _fold(temps[i % 2], scale, acc, wait_n=0)
            continue
        if pending is not None:  # the previous group's wgmma, while this one runs
            _fold(*pending, wait_n=1)
        pending = (temps[i % 2], scale, acc)
    # Waiting here keeps the kernel free of automatic barriers: no wgmma still reads a buffer
    # the pipeline refills after this step.
    if pending is not None:
        _fold(*pending, wait_n=0)


def int4_matmul_t(x, order, n_valid, slots, weights, tiles: Int4Tiles = INT4_TILES,
                  epilogue=None, out_dtype=None, splits: int = 1, name: str = "int4_matmul",
                  x_scale=None):
    """out^T [splits, C, n, O, R]: epilogue(W_1[slot_c] @ x[c]^T, ...) (n = 1), or without an
    epilogue the n = len(weights) products, for the first `n_valid` entries c of `order` (the
    others are left unwritten), each reduction split in `splits`.

    x bf16 [C, R, K] (or [1, R, K] shared by all entries; f16 with `tiles.f16`, the products
    then multiplied by `x_scale` [1] before the epilogue); weights: tuple of (int4 [S, O, K] or
    tile-major [S, O / r, K / b, r, b] (`pool.tile_major`: each step reads one contiguous
    block), bf16 scales [S, K / GROUP, O]). A tile is `rows` output features of one entry and split;
    CTA p streams tiles p, p + P, ... through one TMA pipeline, so with a persistent grid
    (`ctas_per_sm`) the next tile's loads overlap this tile's last steps; with `compute_wgs`
    > 1, a tile is `compute_wgs` warpgroups' rows, fed by a warp-specialized pipeline."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    c_n, (_, r, k) = slots.shape[0], x.shape
    o, nw, bo = weights[0][1].shape[-1], len(weights), tiles.rows
    tile_major = weights[0][0].ndim == 5
    bk = GROUP * tiles.groups
    wgs = tiles.compute_wgs
    bo_cta = bo * wgs  # a CTA's output features: each compute warpgroup's `rows`
    k_steps, blocks = k // bk // splits, o // bo_cta
    per_entry = blocks * splits
    ctas = c_n * per_entry
    if tiles.ctas_per_sm:
        ctas = min(ctas, sm_count() * tiles.ctas_per_sm)
    out_dtype = out_dtype or jnp.bfloat16
    n_out = 1 if epilogue else nw
    out_bytes = n_out * jnp.dtype(out_dtype).itemsize + (4 * nw if tiles.stream_k else 0)
    stages = fitting_stages(tiles, r, nw, out_bytes)
    epilogue = epilogue or (lambda *accs: accs)
    shared_x = x.shape[0] == 1
    n_in = 2 * nw  # weights and their scales

    persistent = tiles.ctas_per_sm > 0
    stream_k = tiles.stream_k
    assert not stream_k or (splits == 1 and wgs == 1 and persistent), tiles

    def body(order_ref, n_ref, slots_ref, x_scale_ref, x_gmem, *refs):
        in_gmem, out_refs = refs[:n_in], refs[n_in:]
        out_gmem, carry_gmem = out_refs[0], (out_refs[1] if stream_k else None)
        o_smem, c_smem = out_refs[1 + stream_k], (out_refs[-1] if stream_k else None)
        p = lax.axis_index("p")
        total = n_ref[0] * per_entry

        def tile_at(t):  # entry, its slot, row block, split of tile t
            entry = order_ref[lax.div(t, per_entry)]
            rest = lax.rem(t, per_entry)
            return entry, slots_ref[entry], lax.div(rest, splits), lax.rem(rest, splits)

        if stream_k:  # steps first, first + 1, ... of the launch's tiles laid end to end
            first, mine = _run_of_steps(p, total * k_steps, ctas, k_steps)

            def where(i):  # the step's tile and its step within that tile
                g = first + i
                return tile_at(lax.div(g, k_steps)), lax.rem(g, k_steps)

            grid = (mine,)
        else:
            if persistent:  # tiles p, p + P, ...: read at each step's index maps
                mine = lax.div(jnp.maximum(total - p + ctas - 1, 0), ctas)

                def tile(i):
                    return tile_at(p + i * ctas)
            else:  # one tile: read once, and a static pipeline grid
                mine, fixed = 1, tile_at(p)

                def tile(_):
                    return fixed

            def where(i, kk):
                return tile(i), kk

            grid = (mine, k_steps)

        def x_index(*idx):
            (entry, _, _, split), kk = where(*idx)
            return (0 if shared_x else entry), split * k_steps + kk

        def w_index(*idx):
            (_, slot, block, split), kk = where(*idx)
            if tile_major:
                return (slot * blocks + block) * (k // bk) + split * k_steps + kk, 0
            return slot * blocks + block, split * k_steps + kk

        def s_index(*idx):
            (_, slot, block, split), kk = where(*idx)
            return slot * (k // bk) + split * k_steps + kk, block

        def finish(tile_now, accs, wg=0):  # the tile's (warpgroup's rows') epilogue, stored
            entry, _, block, split = tile_now
            results = epilogue(*(acc[...] * x_scale_ref[0] for acc in accs))
            results = results if isinstance(results, tuple) else (results,)
            _zero(accs)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store read
            for j, result in enumerate(results):
                o_smem[wg, j] = result.astype(out_dtype)
            plgpu.commit_smem()
            for j in range(n_out):
                row = (((split * c_n + entry) * n_out + j) * blocks + block) * bo_cta + wg * bo
                plgpu.copy_smem_to_gmem(o_smem.at[wg, j], out_gmem.at[pl.ds(row, bo)])

        def store_part(side, accs):  # a cut tile's head (0) or tail (1): its scaled sums
            sums = [acc[...] * x_scale_ref[0] for acc in accs]
            _zero(accs)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            for j, part in enumerate(sums):
                c_smem[j] = part
            plgpu.commit_smem()
            for j in range(nw):
                row = ((side * ctas + p) * nw + j) * bo
                plgpu.copy_smem_to_gmem(c_smem.at[j], carry_gmem.at[pl.ds(row, bo)])

        def step(idx, x_smem, *weight_smem, accs, temps):
            multiply(x_smem, weight_smem, accs, temps)
            tile_now, kk = where(*idx)
            ends = kk == k_steps - 1
            if not stream_k:
                pl.when(ends)(lambda: finish(tile_now, accs))
                return
            began_before = idx[0] < kk  # the tile's head is the previous CTA's
            pl.when(ends & began_before)(lambda: store_part(1, accs))
            pl.when(ends & ~began_before)(lambda: finish(tile_now, accs))
            pl.when(~ends & (idx[0] == mine - 1))(lambda: store_part(0, accs))

        def multiply(x_smem, weight_smem, accs, temps):
            multiply_step(lambda g: x_smem.at[:, pl.ds(g * GROUP, GROUP)].T, weight_smem, accs,
                          temps, tiles)

        # swizzles sized for one group, so that each group's columns are whole tiles
        specs = [plgpu.BlockSpec((r, bk), x_index, transforms=_swizzled(GROUP, 16))]
        for _ in range(nw):
            specs += [plgpu.BlockSpec((bo_cta, bk), w_index, transforms=_swizzled(GROUP, 4)),
                      plgpu.BlockSpec((tiles.groups, bo_cta), s_index)]
        # nw running sums, and two accumulators that the groups' wgmmas alternate between
        accumulators = [plgpu.ACC((bo, r)) for _ in range(nw + 2)]

        def run(*refs):
            accs, temps = refs[:nw], refs[nw:]
            plgpu.emit_pipeline(functools.partial(step, accs=accs, temps=temps),
                                grid=grid, in_specs=specs,
                                max_concurrent_steps=stages)(x_gmem, *in_gmem)

        def warp_specialized():
            wg = lax.axis_index("wg")

            def own(weight_smem):  # this warpgroup's rows of the weight tiles and scales
                rows = pl.ds(wg * bo, bo)
                return [ref.at[rows] if i % 2 == 0 else ref.at[:, rows]
                        for i, ref in enumerate(weight_smem)]

            def ws_step(idx, x_smem, *refs):
                *weight_smem, (accs, temps) = refs
                multiply(x_smem, own(weight_smem), accs, temps)
                tile_now, kk = where(*idx)
                pl.when(kk == k_steps - 1)(lambda: finish(tile_now, accs, wg))
                return accs, temps

            def context(eval_pipeline):
                def scoped(*refs):  # the compute warpgroups' sums, carried through the steps
                    eval_pipeline((refs[:nw], refs[nw:]))
                pl.run_scoped(scoped, *accumulators)

            plgpu.emit_pipeline_warp_specialized(
                ws_step, grid=(mine, k_steps), memory_registers=MEMORY_REGISTERS, in_specs=specs,
                max_concurrent_steps=stages, wg_axis="wg", num_compute_wgs=wgs,
                compute_context=context)(x_gmem, *in_gmem)

        @pl.when(persistent or p < total)
        def _():
            if wgs == 1:
                pl.run_scoped(run, *accumulators)
            else:
                warp_specialized()

        plgpu.wait_smem_to_gmem(0)

    out_type = jax.ShapeDtypeStruct((splits * c_n * n_out * o, r), out_dtype)
    scratch = [plgpu.SMEM((wgs, n_out, bo, r), out_dtype)]
    if stream_k:  # each CTA's head and tail parts of the tiles cut between CTAs, and a buffer
        out_type = (out_type, jax.ShapeDtypeStruct((2 * ctas * nw * bo, r), jnp.float32))
        scratch.append(plgpu.SMEM((nw, bo, r), jnp.float32))
    kernel = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch,
        grid=(ctas,), grid_names=("p",), kernel_name=name,
        **(dict(num_threads=wgs + 1, thread_name="wg") if wgs > 1 else {}),
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True))
    # 2-D views (free reshapes): rows of x by entry, weight rows by slot, scale rows by slot
    args = [a for w, s in weights for a in (w.reshape(-1, bk if tile_major else k),
                                            s.reshape(-1, o))]
    x_scale = jnp.ones((1,), jnp.float32) if x_scale is None else x_scale
    out = kernel(order.astype(jnp.int32), jnp.reshape(n_valid, (1,)).astype(jnp.int32),
                 slots.astype(jnp.int32), x_scale, x.reshape(-1, k), *args)
    if stream_k:
        out, carry = out
        out = _join_cut_tiles(out.reshape(c_n, n_out, blocks, bo, r),
                              carry.reshape(2, ctas, nw, bo, r), order, n_valid, k_steps,
                              epilogue)
    return out.reshape(splits, c_n, n_out, o, r)


def _zero(accs) -> None:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for acc in accs:
        acc[...] = plgpu.layout_cast(jnp.zeros(acc.shape, acc.dtype), plgpu.Layout.WGMMA)


def _run_of_steps(p, steps, ctas: int, k_steps: int):
    """Stream-K: the first step and the number of steps of CTA p's run, equal runs of at least
    a tile's `k_steps` (so a tile is cut at most once: into a head and a tail)."""
    span = jnp.maximum(lax.div(steps + ctas - 1, ctas), k_steps)
    first = jnp.minimum(p * span, steps)
    return first, jnp.minimum(first + span, steps) - first


def _join_cut_tiles(out, carry, order, n_valid, k_steps: int, epilogue):
    """Stream-K's tiles cut between CTAs p - 1 and p: epilogue(head + tail) into their place
    in out [C, n_out, blocks, rows, R]; carry [2 (head, tail), P, weights, rows, R]."""
    c_n, _, blocks = out.shape[:3]
    ctas = carry.shape[1]
    steps = n_valid * blocks * k_steps
    firsts, _ = _run_of_steps(jnp.arange(1, ctas), steps, ctas, k_steps)
    cut = (firsts < steps) & (firsts % k_steps != 0)
    tile = firsts // k_steps
    sums = carry[0, :-1] + carry[1, 1:]
    results = epilogue(*(sums[:, j] for j in range(sums.shape[1])))
    results = jnp.stack(results if isinstance(results, tuple) else (results,), axis=1)
    entry = jnp.where(cut, order[jnp.minimum(tile // blocks, c_n - 1)], c_n)  # c_n: dropped
    return out.at[entry, :, tile % blocks].set(results.astype(out.dtype), mode="drop")


def weight_tile(tiles: Int4Tiles) -> tuple[int, int]:
    """(rows, inputs) of the weight block one kernel step reads: the tile of a tile-major pool
    (`pool.tile_major`) that these tiles run on."""
    return tiles.rows * tiles.compute_wgs, GROUP * tiles.groups


def _operand(x: jax.Array, f16: bool, valid: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Activations [C, n, K] as the kernel reads them: in `permute_k` order, and with `f16`
    scaled into float16 (`as_f16`), with the scale that takes it out again. Entries not
    `valid` are zeroed first: the gate/up kernel leaves theirs unwritten, and garbage must not
    set the scale."""
    if not f16:
        return permute_k(x), None
    if x.shape[0] > 1:
        x = jnp.where(valid[:, None, None], x, jnp.zeros((), x.dtype))
    return as_f16(permute_k(x, f16=True))


@functools.partial(jax.jit, static_argnames=("tiles",))
def grouped_swiglu_int4(x, slots, pool: ExpertPool, valid=None, tiles: Int4Tiles | None = None):
    """Partial sums [C, 1, N, D] float32 for the active slots of an int4 pool (the contract of
    `expert_kernels.grouped_swiglu`); x bf16 [N, D] or [C, N, D] (each entry's own rows).
    `tiles` default: `int4_tiles_for` the pool's expert dims. A tile-major pool must be tiled by
    these tiles' `weight_tile`."""
    tiles = tiles or int4_tiles_for(x.shape[-1], pool.intermediate_size)
    if tiles is None or not int4_fits(x.shape[-1], pool.intermediate_size, tiles):
        raise ValueError(f"int4 experts D={x.shape[-1]}, F={pool.intermediate_size} do not "
                         f"tile by {tiles or INT4_TILES}")
    if pool.tiled and pool.tile != weight_tile(tiles):
        raise ValueError(f"the pool's weights are tile-major by {pool.tile}, {tiles} reads "
                         f"{weight_tile(tiles)} blocks")
    x3 = x if x.ndim == 3 else x[None]
    n0 = x3.shape[1]
    n = -(-n0 // ROW_MULTIPLE) * ROW_MULTIPLE
    valid = jnp.ones(slots.shape, bool) if valid is None else valid != 0
    xp, x_scale = _operand(jnp.pad(x3, ((0, 0), (0, n - n0), (0, 0))), tiles.f16, valid)
    order = jnp.argsort(~valid, stable=True)  # valid entries first; the kernel skips the rest
    n_valid = jnp.sum(valid, dtype=jnp.int32)
    gate_up = ((as_int4(pool.w1), pool.w1_scale), (as_int4(pool.w3), pool.w3_scale))
    if tiles.up_splits == 1:
        h_t = int4_matmul_t(xp, order, n_valid, slots, gate_up, tiles,
                            epilogue=lambda a1, a3: jax.nn.silu(a1) * a3, out_dtype=x.dtype,
                            name="int4_gate_up", x_scale=x_scale)[0, :, 0]
    else:
        parts = int4_matmul_t(xp, order, n_valid, slots, gate_up, tiles, out_dtype=jnp.float32,
                              splits=tiles.up_splits, name="int4_gate_up",
                              x_scale=x_scale)
        parts = ordered_sum(parts, 0)
        h_t = (jax.nn.silu(parts[:, 0]) * parts[:, 1]).astype(x.dtype)
    # [C, n, F]: a few MB, fused into one XLA transpose
    h, h_scale = _operand(jnp.swapaxes(h_t, 1, 2), tiles.f16, valid)
    down = down_tiles(tiles)
    y_t = int4_matmul_t(h, order, n_valid, slots, ((as_int4(pool.w2), pool.w2_scale),), down,
                        out_dtype=jnp.float32, splits=down.down_splits, name="int4_down",
                        x_scale=h_scale)
    y = jnp.where(valid[:, None, None], ordered_sum(y_t[:, :, 0], 0), 0.0)  # invalid: unwritten
    return jnp.swapaxes(y, 1, 2)[:, None, :n0]
