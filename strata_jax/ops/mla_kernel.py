"""Multi-head latent attention (MLA, DeepSeek-V3) at decode: a Pallas Triton kernel, XLA otherwise.

With the up-projections absorbed (`decoder.attend_mla`), one decode step of MLA is multi-query
attention with a single shared kv "head": every query head h of row b scores the same latent
cache rows, scores[b,h,s] = scale * (q_lat[b,h] . latent[b,s] + q_rope[b,h] . k_rope[b,s]), and
mixes those same rows, out[b,h] = sum_s softmax(scores[b,h])[s] * latent[b,s]. XLA runs that as
two einsums over the whole cache (S = max_len rows, also those past the row's length) with the
[B, H, S] scores written out between them.

The kernel (flash-decoding, as FlashMLA lays it out) reads the cache once: a program owns one
row b, one block of `block_h` heads and one of `splits` contiguous ranges of the row's valid
length; it loads a [block_s, r] latent block and its [block_s, dr] rope keys once per step and
scores all of its heads against them with one dot, keeps an online softmax (running max and
sum per head) and a float32 [block_h, r] accumulator in registers, and writes its partial
(max, sum, accumulator). `_combine` (XLA) merges the splits. The loop bound comes from the
row's length, so blocks past it are never read: a short row costs little, whatever max_len.

Why a head block and not all H = 128 heads per program: the f32 accumulator [128, 512] alone
is 256 KiB, an H100 SM's whole register file. With block_h < H, the H / block_h programs of one
(row, split) read the same latent blocks; they are launched next to each other (heads are the
grid's fastest axis), so all but the first read them from L2, not HBM.

Precision: the scores, the softmax and the accumulator are float32; the probabilities are
rounded to the latent's dtype for the mix dot (bf16 x bf16 -> f32 on the tensor cores), as
`attend_mla` rounds them (there, after normalizing; here, the unnormalized exp(s - running
max) in [0, 1], each within the same relative 2**-9). Keeping them float32 would need the
[block_s, r] latent block converted to float32 in registers for a float32 dot: twice the
registers or shared memory per block, and no bf16 tensor-core path. The result is float32
[B, H, r], normalized: the caller rounds it (attend_mla's `mixed` is in the latent's dtype).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from strata_jax.ops.expert_kernels import triton_params
from strata_jax.ops.layers import NEG_INF, einsum_f32, ordered_sum

MIN_BLOCK = 16  # smallest dot dimension Triton takes; tiles are powers of two >= it
TARGET_PROGRAMS = 132  # one wave of an H100's 132 SMs (more splits cost partials: see below)
MIN_SPLIT_BLOCKS = 4  # fewest blocks of a full-length row per split (else fewer splits)
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclass(frozen=True, kw_only=True)
class MlaTiles:
    """Tile sizes and launch settings of `mla_decode`."""

    block_h: int = 64
    """Query heads per program; a power of two >= 16 dividing H (FlashMLA's 64 for H=128)."""
    block_s: int = 32
    """Cache rows per loop step; a power of two >= 16 dividing S."""
    splits: int = 1
    """Programs per (row, head block), each over an equal share of the row's valid length."""
    num_warps: int = 8
    """Warps per program (the [block_h, r] float32 accumulator is spread over them)."""
    num_stages: int = 2
    """Software pipeline depth of the cache loop (latent blocks in flight)."""


def _is_block(size: int) -> bool:
    return size >= MIN_BLOCK and size & (size - 1) == 0


def mla_misfit(heads: int, rank: int, rope_dim: int, seq: int, tiles: MlaTiles) -> str | None:
    """Why `tiles` cannot run H heads over a [S, r] latent and [S, dr] rope key, or None.
    Triton tensors have power-of-two sides and its dots take sides >= 16, so r and dr (whole
    in every block) and both block sizes must be such, and the blocks must divide H and S."""
    if not all(_is_block(n) for n in (rank, rope_dim, tiles.block_h, tiles.block_s)):
        return (f"r={rank}, dr={rope_dim}, block_h={tiles.block_h} and block_s={tiles.block_s}"
                f" must be powers of two >= {MIN_BLOCK}")
    if heads % tiles.block_h or seq % tiles.block_s:
        return f"H={heads} or S={seq} is not a multiple of block_h or block_s: {tiles}"
    if min(tiles.splits, tiles.num_warps, tiles.num_stages) < 1:
        return f"splits, num_warps and num_stages must be >= 1: {tiles}"
    return None


def mla_splits_for(batch: int, heads: int, rank: int, rope_dim: int, seq: int,
                   block_h: int, block_s: int) -> int:
    """The fewest splits (a power of two) that launch TARGET_PROGRAMS programs, within two
    limits: every split gets MIN_SPLIT_BLOCKS blocks of a full row, and the partials of a row
    (each split's float32 [H, r] accumulator, written, then read by `_combine`: 8 * H * r
    bytes) cost no more traffic than the row's cache (S * (r + dr) * 2 bytes). Splits only
    buy parallelism for few rows; at short S their partials outweigh the cache itself."""
    programs, blocks = batch * (heads // block_h), seq // block_s
    most = min(blocks // MIN_SPLIT_BLOCKS, seq * (rank + rope_dim) * 2 // (8 * heads * rank))
    splits = 1
    while programs * splits < TARGET_PROGRAMS and 2 * splits <= most:
        splits *= 2
    return splits


def _halvings(size: int) -> list[int]:
    return [size >> i for i in range(size.bit_length()) if size >> i >= MIN_BLOCK]


def mla_tiles_for(batch: int, heads: int, rank: int, rope_dim: int, seq: int,
                  base: MlaTiles | None = None) -> MlaTiles | None:
    """`base` (default MlaTiles()) with block_h, then block_s, halved until they divide H and
    S, num_warps scaled to the accumulator (block_h / 8, at least 4: 64 registers of it per
    thread) and splits from `mla_splits_for`; None if no tiles fit."""
    base = base or MlaTiles()
    for bh in _halvings(base.block_h):
        for bs in _halvings(base.block_s):
            tiles = MlaTiles(block_h=bh, block_s=bs, num_warps=max(4, bh // 8),
                             splits=mla_splits_for(batch, heads, rank, rope_dim, seq, bh, bs),
                             num_stages=base.num_stages)
            if mla_misfit(heads, rank, rope_dim, seq, tiles) is None:
                return tiles
    return None


def use_mla_kernel(batch: int, heads: int, rank: int, rope_dim: int, seq: int,
                   dtype) -> bool:
    """The one place that picks the MLA decode path: the kernel on a GPU for bf16/f32 caches
    of shapes that tile, XLA (`mla_decode_xla`) otherwise. `STRATA_MLA_KERNEL=0` in the
    environment (read when a program is traced) keeps XLA's path, for A/B measurements."""
    if os.environ.get("STRATA_MLA_KERNEL", "1") == "0":
        return False
    return (jax.default_backend() == "gpu" and jnp.dtype(dtype) in KERNEL_DTYPES
            and mla_tiles_for(batch, heads, rank, rope_dim, seq) is not None)


def _dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b [n, k].T in float32 (a transposed operand of the dot, no copy in memory)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _split_range(length, split, splits: int, block_s: int):
    """[start, start + blocks * block_s) of the row's valid length [0, length) that `split`
    owns: equal shares rounded up to whole blocks, so a short row still spreads over the
    splits (and start is block-aligned: every block lies inside S). Splits past the length
    get no blocks."""
    share = jax.lax.div(jax.lax.div(length + splits - 1, splits) + block_s - 1, block_s)
    start = split * share * block_s
    end = jnp.minimum(start + share * block_s, length)
    return start, jnp.maximum(jax.lax.div(end - start + block_s - 1, block_s), 0)


def _kernel(len_ref, ql_ref, qr_ref, lat_ref, kr_ref, acc_ref, m_ref, denom_ref, *,
            scale: float, tiles: MlaTiles):
    h, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bh, bs = tiles.block_h, tiles.block_s
    heads = pl.ds(pl.multiple_of(h * bh, bh), bh)
    q_lat, q_rope = ql_ref[b, heads, :], qr_ref[b, heads, :]  # loaded once, before the loop
    length = len_ref[b]
    start, blocks = _split_range(length, split, tiles.splits, bs)

    def body(i, carry):
        m, denom, acc = carry
        first = pl.multiple_of(start + i * bs, bs)
        latent = lat_ref[b, pl.ds(first, bs), :]  # read once for all bh heads
        s = (_dot_t(q_lat, latent) + _dot_t(q_rope, kr_ref[b, pl.ds(first, bs), :])) * scale
        s = jnp.where((first + jnp.arange(bs))[None, :] < length, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)  # rescales what earlier blocks summed
        p = jnp.exp(s - m_new[:, None])
        mix = jnp.dot(p.astype(latent.dtype), latent, preferred_element_type=jnp.float32)
        return m_new, denom * alpha + p.sum(axis=1), acc * alpha[:, None] + mix

    init = (jnp.full((bh,), NEG_INF, jnp.float32), jnp.zeros((bh,), jnp.float32),
            jnp.zeros((bh, ql_ref.shape[-1]), jnp.float32))
    m, denom, acc = jax.lax.fori_loop(0, blocks, body, init)
    acc_ref[...] = acc[None, None]
    m_ref[...] = m[None, None]
    denom_ref[...] = denom[None, None]


def _combine(acc: jax.Array, m: jax.Array, denom: jax.Array) -> jax.Array:
    """The splits' partials (acc [B, splits, H, r], running max and sum [B, splits, H]) merged
    into the normalized [B, H, r]: each split rescaled to the common max, summed in split
    order (`ordered_sum`: a fixed rounding). A split with no blocks has max NEG_INF and weighs
    exp(-1e30 - max) = 0; a row of length 0 has sum 0 everywhere and gives zeros."""
    w = jnp.exp(m - m.max(axis=1, keepdims=True))
    total = ordered_sum(w * denom, 1)
    out = ordered_sum(w[..., None] * acc, 1)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def _check_operands(q_lat, q_rope, latent, k_rope, lengths, tiles: MlaTiles) -> None:
    (b, h, r), dr, s = q_lat.shape, q_rope.shape[-1], latent.shape[1]
    if (q_rope.shape != (b, h, dr) or latent.shape != (b, s, r) or k_rope.shape != (b, s, dr)
            or lengths.shape != (b,)):
        raise ValueError(f"need q_lat [B,H,r], q_rope [B,H,dr], latent [B,S,r], k_rope "
                         f"[B,S,dr], lengths [B]: {q_lat.shape}, {q_rope.shape}, "
                         f"{latent.shape}, {k_rope.shape}, {lengths.shape}")
    dtypes = {jnp.dtype(x.dtype) for x in (q_lat, q_rope, latent, k_rope)}
    if len(dtypes) != 1 or dtypes.pop() not in KERNEL_DTYPES:
        raise ValueError(f"need one dtype (bf16 or f32) for q and the cache, got {dtypes}")
    reason = mla_misfit(h, r, dr, s, tiles)
    if reason:
        raise ValueError(reason)


@functools.partial(jax.jit, static_argnames=("scale", "block_h", "block_s", "splits",
                                             "num_warps", "num_stages", "interpret"))
def mla_decode(q_lat: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
               lengths: jax.Array, scale: float, *, block_h: int | None = None,
               block_s: int | None = None, splits: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               interpret: bool = False) -> jax.Array:
    """One decode step of absorbed MLA: q_lat [B, H, r], q_rope [B, H, dr] over the cache's
    latent [B, S, r] and rope key [B, S, dr] (one dtype, bf16 or f32), attending to the
    positions s < lengths[b] (the engine's mask `arange(S) <= position`: lengths =
    position + 1; clipped to [0, S]; a row of length 0 gives zeros), softmax scale `scale`
    (static: `decoder.mla_scale`). Returns float32 [B, H, r], the probability-weighted
    latent. Tile arguments left None take `mla_tiles_for`'s (splits: `mla_splits_for` of the
    blocks used; num_warps: block_h / 8, at least 4). Cache rows at or past a row's length
    may be read (in its last block) and must be finite, as for the XLA path, where they are
    weighted by zero too."""
    (b, h, r), dr, s = q_lat.shape, q_rope.shape[-1], latent.shape[1]
    auto = mla_tiles_for(b, h, r, dr, s) or MlaTiles()
    bh, bs = block_h or auto.block_h, block_s or auto.block_s
    tiles = MlaTiles(block_h=bh, block_s=bs,
                     splits=splits or mla_splits_for(b, h, r, dr, s, bh, bs),
                     num_warps=num_warps or max(4, bh // 8),
                     num_stages=num_stages or auto.num_stages)
    _check_operands(q_lat, q_rope, latent, k_rope, lengths, tiles)
    grid = (h // tiles.block_h, tiles.splits, b)  # heads fastest: their programs share blocks
    part = (b, tiles.splits, h)
    acc, m, denom = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), tiles=tiles),
        grid=grid,
        out_shape=(jax.ShapeDtypeStruct((*part, r), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32)),
        out_specs=(pl.BlockSpec((1, 1, tiles.block_h, r), lambda hi, si, bi: (bi, si, hi, 0)),
                   pl.BlockSpec((1, 1, tiles.block_h), lambda hi, si, bi: (bi, si, hi)),
                   pl.BlockSpec((1, 1, tiles.block_h), lambda hi, si, bi: (bi, si, hi))),
        compiler_params=triton_params(tiles),
        interpret=interpret,
    )(jnp.clip(lengths.astype(jnp.int32), 0, s), q_lat, q_rope, latent, k_rope)
    return _combine(acc, m, denom)


def mla_decode_xla(q_lat: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                   lengths: jax.Array, scale: float) -> jax.Array:
    """`mla_decode`'s contract in `attend_mla`'s XLA formula at T = 1 (float32 scores and
    softmax, the probabilities rounded to the latent's dtype before the mix), accumulated and
    returned in float32: the fallback off the GPU and the kernel's reference."""
    scores = (einsum_f32("bhr,bsr->bhs", q_lat, latent)
              + einsum_f32("bhd,bsd->bhs", q_rope, k_rope))
    valid = jnp.arange(latent.shape[1])[None, None, :] < lengths[:, None, None]
    probs = jax.nn.softmax(jnp.where(valid, scores * scale, NEG_INF), axis=-1)
    return einsum_f32("bhs,bsr->bhr", probs.astype(latent.dtype), latent)


def bytes_read(batch: int, seq: int, rank: int, rope_dim: int, itemsize: int = 2) -> int:
    """Bytes of the cache one full-length decode step reads: B * S * (r + dr) * itemsize."""
    return batch * seq * (rank + rope_dim) * itemsize

