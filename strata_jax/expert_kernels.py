"""Grouped SwiGLU over pool slots: a Pallas (Triton) kernel for decode, an XLA path otherwise.

Both compute, for each active slot c, y[c] = (silu(x @ w1[s_c]) * (x @ w3[s_c])) @ w2[s_c],
reading each slot's weights straight out of the pool (no gathered copy of the experts).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from strata_jax.layers import einsum_f32
from strata_jax.pool import ExpertPool
from strata_jax.quant import GROUP as INT4_GROUP

PALLAS_MAX_ROWS = 32  # decode shapes; larger row counts take the XLA path
ROW_TILE = 16  # fewest rows a Triton dot takes; above it, experts get their own rows


@dataclass(frozen=True)
class Tiles:
    """Pallas tile sizes: reduction block, gate/up output block, down output block, K splits."""

    bk: int = 128
    bf: int = 64
    bd: int = 64
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 4
    fold_offset: bool = True  # int4: fold the -8 nibble offset into a row-sum correction
    magic: bool = False  # int4: nibbles to floats by bit tricks, not int->float conversions
    unroll: int = 1  # reduction blocks per loop iteration (more loads in flight per step)
    asm: bool = False  # int4 + bf16 on GPU: magic planes by inline PTX, four bytes at a time
    transpose: bool = False  # weights as the dot's left operand: y^T = W^T x^T


def _compiler_params(tiles: Tiles):
    try:
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    except (ImportError, AttributeError):  # CPU-only installs lack the Triton lowering
        return None


# float bits whose mantissa's low bits take a nibble n: bf16 0x4300 = 128, f32 0x4B000000 = 2^23
_MAGIC = {jnp.dtype(jnp.bfloat16): (jnp.uint16, 0x4300, 128.0),
          jnp.dtype(jnp.float32): (jnp.uint32, 0x4B000000, 2.0**23)}


def _magic_nibbles(nibbles, dtype, offset: bool = True):
    """uint8 nibbles n (0..15) -> n - 8 in `dtype`, exactly: OR n into the mantissa of a
    power of two (no int->float conversion, which is slow on GPUs), then subtract base + 8.
    `offset=False` skips the subtraction: base + n, for the caller to fold base + 8 in."""
    uint, bits, base = _MAGIC[jnp.dtype(dtype)]
    value = jax.lax.bitcast_convert_type(nibbles.astype(uint) | uint(bits), dtype)
    return value - jnp.asarray(base + 8.0, dtype) if offset else value


def _ptx_magic(high: bool, offset: bool) -> str:
    """PTX for four packed bytes ($2) -> their low (or high) nibbles as two bf16 pairs ($0, $1)
    holding 128 + n (n - 8 with `offset`): byte-permute two bytes into 16-bit lanes, then one
    lop3 (t & 0x000F000F) | 0x43004300 makes two bf16 values at once."""
    src = "s" if high else "$2"
    lines = ["{", ".reg .b32 s, t0, t1, z, m, b, one, neg;", "mov.b32 z, 0;",
             "mov.b32 m, 0x000F000F;", "mov.b32 b, 0x43004300;"]
    if high:
        lines.append("shr.u32 s, $2, 4;")
    lines += [f"prmt.b32 t0, {src}, z, 0x4140;", f"prmt.b32 t1, {src}, z, 0x4342;"]
    for i in range(2):
        if offset:  # (128 + n) * 1 - 136, exact in bf16
            lines += ["mov.b32 one, 0x3F803F80;", "mov.b32 neg, 0xC308C308;"] if i == 0 else []
            lines += [f"lop3.b32 t{i}, t{i}, m, b, 0xEA;",
                      f"fma.rn.bf16x2 ${i}, t{i}, one, neg;"]
        else:
            lines.append(f"lop3.b32 ${i}, t{i}, m, b, 0xEA;")
    return "\n".join(lines + ["}"])


def _asm_nibbles(p, offset: bool):
    """(low, high) bf16 nibble planes of packed bytes p by inline PTX (GPU only); the same
    values as `_magic_nibbles`. One call per plane: Pallas lowers only single-result asm."""
    from jax.experimental.pallas import triton as pltriton

    plane = jax.ShapeDtypeStruct(p.shape, jnp.bfloat16)
    return tuple(
        pltriton.elementwise_inline_asm(
            _ptx_magic(high, offset), args=[p], constraints="=r,=r,r", pack=4,
            result_shape_dtypes=[plane])[0]
        for high in (False, True))


def _nibble_values(p, dtype, fold_offset: bool, magic: bool, asm: bool = False):
    """(low, high) nibble planes of packed bytes p as `dtype`, and the offset still to be
    subtracted as offset * row sum of x (0 when the planes already hold n - 8).

    Folding the offset spares a per-element subtraction; with magic bf16 planes the offset is
    128 + 8 (products stay exact in the float32 accumulator; 2^23 for float32 would not).
    `asm` (bf16 only) makes the magic planes with inline PTX instead of jnp bit operations."""
    if asm and jnp.dtype(dtype) == jnp.bfloat16:
        lo, hi = _asm_nibbles(p, offset=not fold_offset)
        return lo, hi, 136.0 if fold_offset else 0.0
    if magic:
        fold = fold_offset and jnp.dtype(dtype) == jnp.bfloat16
        lo, hi = (_magic_nibbles(q, dtype, offset=not fold) for q in (p & 0xF, p >> 4))
        return lo, hi, _MAGIC[jnp.dtype(dtype)][2] + 8.0 if fold else 0.0
    if fold_offset:  # nibbles straight to floats (0..15)
        return (p & 0xF).astype(dtype), (p >> 4).astype(dtype), 8.0
    p = p.astype(jnp.int32)
    return ((p & 0xF) - 8).astype(dtype), ((p >> 4) - 8).astype(dtype), 0.0


def _dot(a, b, transpose: bool):
    """a @ b in float32, or (a @ b)^T = b^T a^T computed with b's tile as the left operand."""
    if transpose:
        return jnp.dot(b.T, a.T, preferred_element_type=jnp.float32)
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _x_blocks(xblock, k, tiles: Tiles, quantized: bool) -> tuple:
    """x[:, K block k], as its two 64-column halves for int4 pools (low, high nibbles)."""
    bk = tiles.bk
    if not quantized:
        return (xblock(k * bk, bk),)
    return xblock(k * bk, bk // 2), xblock(k * bk + bk // 2, bk // 2)


def _block_dot(xs: tuple, w, slot, k, cols, tiles: Tiles, asm: bool):
    """x[:, K block k] @ W[slot][K block k, cols] in float32 ([cols, N] if tiles.transpose),
    with xs from `_x_blocks` (loaded once per block, shared by gate and up).

    `w` is (weights,) for a float pool or (packed, scales) for int4: then block k is one
    128-row group whose bytes hold rows j (low nibble) and j + 64 (high nibble).
    """
    bk, t = tiles.bk, tiles.transpose
    if len(w) == 1:  # weights in the activations' dtype, as the XLA path computes them
        return _dot(xs[0], w[0][slot, pl.ds(k * bk, bk), cols].astype(xs[0].dtype), t)
    packed_ref, scale_ref = w
    half = bk // 2
    p = packed_ref[slot, pl.ds(k * half, half), cols]
    x_lo, x_hi = xs
    lo, hi, offset = _nibble_values(p, x_lo.dtype, tiles.fold_offset, tiles.magic, asm)
    acc = _dot(x_lo, lo, t) + _dot(x_hi, hi, t)
    scale = scale_ref[slot, pl.ds(k, 1), cols].astype(jnp.float32)
    if offset:
        rows = jnp.sum(x_lo.astype(jnp.float32), 1) + jnp.sum(x_hi.astype(jnp.float32), 1)
        acc -= offset * (rows[None, :] if t else rows[:, None])
    return acc * (scale.T if t else scale)


def _reduce_blocks(steps: int, first, block, count: int, shape, tiles: Tiles):
    """The `count` sums of `block(k)` (a tuple) over k in [first, first + steps), with
    `tiles.unroll` blocks per iteration; returned as [N, cols] whatever the dot orientation."""
    def body(i, accs):
        for u in range(tiles.unroll):
            parts = block(first + i * tiles.unroll + u)
            accs = tuple(a + part for a, part in zip(accs, parts, strict=True))
        return accs

    n, cols = shape
    zero = jnp.zeros((cols, n) if tiles.transpose else (n, cols), jnp.float32)
    accs = jax.lax.fori_loop(0, steps // tiles.unroll, body, (zero,) * count)
    return tuple(a.T if tiles.transpose else a for a in accs)


def _gate_up_kernel(slots_ref, valid_ref, x_ref, *refs, tiles: Tiles, nw: int, asm: bool):
    w1, w3, h_ref = refs[:nw], refs[nw : 2 * nw], refs[-1]
    c, j = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[c]
    xi = c if x_ref.shape[0] > 1 else 0  # rows per entry [C, n, D], or shared [1, n, D]
    n, d = x_ref.shape[1:]
    cols = pl.ds(j * tiles.bf, tiles.bf)

    def xblock(start, size):
        return x_ref[xi, :, pl.ds(start, size)]

    def block(k):
        xs = _x_blocks(xblock, k, tiles, nw == 2)
        return (_block_dot(xs, w1, slot, k, cols, tiles, asm),
                _block_dot(xs, w3, slot, k, cols, tiles, asm))

    @pl.when(valid_ref[c] != 0)
    def _():
        a1, a3 = _reduce_blocks(d // tiles.bk, 0, block, 2, (n, tiles.bf), tiles)
        h_ref[...] = (jax.nn.silu(a1) * a3).astype(h_ref.dtype)[None]

    @pl.when(valid_ref[c] == 0)
    def _():
        h_ref[...] = jnp.zeros(h_ref.shape, h_ref.dtype)


def _down_kernel(slots_ref, valid_ref, h_ref, *refs, tiles: Tiles, nw: int, asm: bool):
    w2, y_ref = refs[:nw], refs[-1]
    c, s, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[c]
    n, f = h_ref.shape[1], h_ref.shape[2]
    steps = f // tiles.bk // tiles.split_k
    cols = pl.ds(j * tiles.bd, tiles.bd)

    def xblock(start, size):
        return h_ref[c, :, pl.ds(start, size)]

    def block(k):
        xs = _x_blocks(xblock, k, tiles, nw == 2)
        return (_block_dot(xs, w2, slot, k, cols, tiles, asm),)

    @pl.when(valid_ref[c] != 0)
    def _():
        (acc,) = _reduce_blocks(steps, s * steps, block, 1, (n, tiles.bd), tiles)
        y_ref[...] = acc[None, None]

    @pl.when(valid_ref[c] == 0)
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)


def check_tiles(d: int, f: int, tiles: Tiles, quantized: bool = False) -> None:
    if d % tiles.bk or f % tiles.bk or f % tiles.bf or d % tiles.bd:
        raise ValueError(f"expert dims D={d}, F={f} are not multiples of the tiles {tiles}")
    if (f // tiles.bk) % tiles.split_k:
        raise ValueError(f"F={f} / bk={tiles.bk} is not divisible by split_k={tiles.split_k}")
    if (d // tiles.bk) % tiles.unroll or (f // tiles.bk // tiles.split_k) % tiles.unroll:
        raise ValueError(f"the reduction blocks of D={d}, F={f} do not split by {tiles}")
    if quantized and tiles.bk != INT4_GROUP:
        raise ValueError(f"int4 pools need bk = group size {INT4_GROUP}, got {tiles.bk}")


def _weights(pool: ExpertPool) -> tuple[tuple, tuple, tuple]:
    if pool.quantized:
        return (pool.w1, pool.w1_scale), (pool.w3, pool.w3_scale), (pool.w2, pool.w2_scale)
    return (pool.w1,), (pool.w3,), (pool.w2,)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def grouped_swiglu_pallas(x, slots, pool: ExpertPool, tiles: Tiles = Tiles(),
                          interpret: bool = False, valid=None):
    """x [N, D] (N <= PALLAS_MAX_ROWS), slots [C] -> partial sums [C, split_k, N, D] float32.
    x may also be [C, N, D]: each entry's own rows (`moe.chunk_picks`).

    Entries whose `valid` [C] is false read no weights and give zeros."""
    x3 = x if x.ndim == 3 else x[None]
    n0, d = x3.shape[1:]
    f = pool.intermediate_size
    check_tiles(d, f, tiles, pool.quantized)
    n = -(-n0 // ROW_TILE) * ROW_TILE  # Triton dots need >= 16 rows
    xp = jnp.zeros((x3.shape[0], n, d), x.dtype).at[:, :n0].set(x3)
    c = slots.shape[0]
    valid = jnp.ones((c,), jnp.int32) if valid is None else valid.astype(jnp.int32)
    params = _compiler_params(tiles)
    asm = tiles.asm and not interpret  # interpret mode computes the same values with jnp
    w1, w3, w2 = _weights(pool)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, tiles=tiles, nw=len(w1), asm=asm),
        grid=(c, f // tiles.bf),
        out_shape=jax.ShapeDtypeStruct((c, n, f), x.dtype),
        out_specs=pl.BlockSpec((1, n, tiles.bf), lambda ci, j: (ci, 0, j)),
        compiler_params=params,
        interpret=interpret,
    )(slots, valid, xp, *w1, *w3)
    partial = pl.pallas_call(
        functools.partial(_down_kernel, tiles=tiles, nw=len(w2), asm=asm),
        grid=(c, tiles.split_k, d // tiles.bd),
        out_shape=jax.ShapeDtypeStruct((c, tiles.split_k, n, d), jnp.float32),
        out_specs=pl.BlockSpec((1, 1, n, tiles.bd), lambda ci, s, j: (ci, s, 0, j)),
        compiler_params=params,
        interpret=interpret,
    )(slots, valid, h, *w2)
    return partial[:, :, :n0]


def grouped_swiglu_xla(x, slots, pool: ExpertPool, valid=None):
    """Same contract (with split_k = 1) via a gather of the active slots and einsums (any N)."""
    w1, w3, w2 = (pool.dense_weights(kind, slots, x.dtype) for kind in ("w1", "w3", "w2"))
    rows = "cnd" if x.ndim == 3 else "nd"
    gate = jnp.einsum(f"{rows},cdf->cnf", x, w1)
    up = jnp.einsum(f"{rows},cdf->cnf", x, w3)
    y = einsum_f32("cnf,cfd->cnd", jax.nn.silu(gate) * up, w2)[:, None]
    return y if valid is None else jnp.where(valid[:, None, None, None], y, 0.0)


TILES = Tiles()  # tuned on the H200 for Mixtral-8x7B experts: benchmarks/README.md
# int4: the best of the sweep in benchmarks/results/int4_experts.md (Mixtral experts, 64 rows)
TILES_INT4 = Tiles(bf=128, bd=128, split_k=4, num_warps=4, num_stages=3, fold_offset=False,
                   magic=True, asm=True)
MIN_SPLIT_STEPS = 16  # shorter split-K loops spend their time filling the load pipeline


def tiles_for(d: int, f: int, base: Tiles | None = None, quantized: bool = False) -> Tiles | None:
    """`base` with the largest split_k <= base.split_k that divides the down projection's K
    steps into loops of at least MIN_SPLIT_STEPS (else 1), or None if nothing fits."""
    base = base or (TILES_INT4 if quantized else TILES)
    for split in range(base.split_k, 0, -1):
        if split > 1 and f // base.bk // split < MIN_SPLIT_STEPS:
            continue
        tiles = dataclasses.replace(base, split_k=split)
        try:
            check_tiles(d, f, tiles, quantized)
        except ValueError:
            continue
        return tiles
    return None


def use_pallas(n: int, d: int, f: int, quantized: bool = False) -> bool:
    """The one place that picks the expert path: Pallas on GPU for decode-sized batches."""
    if jax.default_backend() != "gpu" or n > PALLAS_MAX_ROWS:
        return False
    return tiles_for(d, f, quantized=quantized) is not None


def use_row_chunks(n: int, d: int, f: int, quantized: bool = False) -> bool:
    """Whether each expert should multiply only its own rows (chunks of ROW_TILE) rather than
    all n: on the Pallas path, where rows are padded to ROW_TILE anyway, once n exceeds it."""
    return n > ROW_TILE and use_pallas(n, d, f, quantized)


def grouped_swiglu(x, slots, pool: ExpertPool, valid=None):
    """Partial sums [C, S, N, D] float32 for the active slots (sum over S gives each slot's
    output; zeros where `valid` [C] is false), by the path `use_pallas` picks. x is [N, D],
    or [C, N, D] with each entry's own rows."""
    d, f = x.shape[-1], pool.intermediate_size
    if use_pallas(x.shape[-2], d, f, pool.quantized):
        tiles = tiles_for(d, f, quantized=pool.quantized)
        return grouped_swiglu_pallas(x, slots, pool, tiles=tiles, valid=valid)
    return grouped_swiglu_xla(x, slots, pool, valid)
