"""Weight quantization formats as pure functions (see docs/quantization.md).

Weights are `[in, out]` (K, N), used as `x @ w`. Two formats:

* int4, symmetric, group-wise along the input dim (routed experts). `q = clip(round(W / s),
  -8, 7)` with one bfloat16 scale per (group of `group` input rows, output column). The packed
  bytes are stored output-major, `[..., N, K/2]` (the transpose, like a torch Linear weight),
  byte `[n, i]` holding `q[2i, n]` in its low nibble and `q[2i + 1, n]` in its high nibble as
  two's-complement int4: exactly the memory of an `int4 [..., N, K]` array, which the Hopper
  kernel (`int4_kernel`) loads K-contiguous and feeds to the tensor cores from registers.
* int8, symmetric, per output channel (dense / attention / shared weights):
  `q = clip(round(W / s), -127, 127)` with one bfloat16 scale per output column. Because the
  scale is per column, `x @ (q * s) == (x @ q) * s` and it can be applied after the matmul.

Scales are rounded to bfloat16 *before* `q` is computed, so dequantization is exact with respect
to the stored scales. All functions accept leading batch axes (`[..., K, N]`) except where noted.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

GROUP = 128
INT4_MIN, INT4_MAX = -8, 7
INT8_MAX = 127
BF16 = np.dtype(ml_dtypes.bfloat16)
SCALE_METHODS = ("absmax", "mse")
SEARCH_SHRINK = tuple(float(r) for r in np.linspace(0.6, 1.0, 21))


class Int4Weight(NamedTuple):
    """Packed int4 weight: packed uint8 [..., N, K/2], scales bfloat16 [..., K/group, N]."""

    packed: np.ndarray
    scales: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the unquantized weight [..., K, N]."""
        *lead, n, half = self.packed.shape
        return (*lead, 2 * half, n)

    @property
    def group(self) -> int:
        return self.shape[-2] // self.scales.shape[-2]


class Int8Weight(NamedTuple):
    """Per-output-channel int8 weight: q int8 [..., K, N], scales bfloat16 [..., N]."""

    q: np.ndarray
    scales: np.ndarray


# --------------------------------------------------------------------------- validation


def check_group(k: int, group: int = GROUP, name: str | None = None) -> None:
    """Raise ValueError unless the input dim `k` splits into whole groups of `group` rows."""
    where = f"{name}: " if name else ""
    if group <= 0 or group % 2:
        raise ValueError(f"{where}int4 group size must be a positive even number, got {group}")
    if k <= 0 or k % group:
        raise ValueError(
            f"{where}int4 quantization needs the input dim K={k} to be a multiple of the "
            f"group size {group}"
        )


def _check_finite(w: np.ndarray, name: str | None) -> None:
    if not np.all(np.isfinite(w)):
        where = f"{name}: " if name else ""
        raise ValueError(f"{where}cannot quantize a weight with non-finite values")


def _as_float32(w: np.ndarray, name: str | None) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim < 2:
        where = f"{name}: " if name else ""
        raise ValueError(f"{where}expected a weight [..., K, N], got shape {w.shape}")
    w = w.astype(np.float32)
    _check_finite(w, name)
    return w


def to_bf16(s: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (round-to-nearest-even)."""
    return np.asarray(s, np.float32).astype(BF16)


def quantize_with_scales(w: np.ndarray, scales: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """clip(round(w / s), qmin, qmax) as int8, with q = 0 where s == 0; shapes broadcast.

    Pass the scales unexpanded (e.g. [..., G, 1, N] against grouped weights [..., G, group,
    N]): the work is then one division, a rounding and a clip in place over the weight, the
    pass over the rare zero scales only where there are some."""
    s = np.asarray(scales, np.float32)
    zero = s == 0
    q = np.divide(np.asarray(w, np.float32), np.where(zero, np.float32(1), s))
    np.rint(q, out=q)  # half to even, as np.round
    np.clip(q, np.float32(qmin), np.float32(qmax), out=q)
    if zero.any():
        q[np.broadcast_to(zero, q.shape)] = 0
    return q.astype(np.int8)


# --------------------------------------------------------------------------- int4


def pack_int4(q: np.ndarray, group: int = GROUP, name: str | None = None) -> np.ndarray:
    """int8 [..., K, N] in [-8, 7] -> uint8 [..., N, K/2]: K pairs, two's-complement nibbles."""
    q = np.asarray(q)
    *lead, k, n = q.shape
    check_group(k, group, name)
    if q.size and (q.min() < INT4_MIN or q.max() > INT4_MAX):
        raise ValueError(f"int4 values must lie in [-8, 7], got [{q.min()}, {q.max()}]")
    u = np.swapaxes(q, -1, -2).astype(np.uint8) & 0x0F
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: np.ndarray, group: int = GROUP) -> np.ndarray:
    """uint8 [..., N, K/2] -> int8 [..., K, N] in [-8, 7]."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise ValueError(f"packed int4 must be uint8, got {packed.dtype}")
    *lead, n, half = packed.shape
    check_group(2 * half, group)
    pairs = np.stack([packed << 4, packed & 0xF0], axis=-1).view(np.int8) >> 4
    return np.swapaxes(pairs.reshape(*lead, n, 2 * half), -1, -2)


def int4_absmax_scales(w: np.ndarray, group: int = GROUP, name: str | None = None) -> np.ndarray:
    """Per-group scales max|W_group| / 7 rounded to bfloat16: [..., K, N] -> [..., K/group, N]."""
    *lead, k, n = w.shape
    check_group(k, group, name)
    absmax = np.abs(w).reshape(*lead, k // group, group, n).max(axis=-2)
    return to_bf16(absmax / np.float32(INT4_MAX))


def int4_mse_scales(
    w: np.ndarray,
    group: int = GROUP,
    name: str | None = None,
    shrink: tuple[float, ...] = SEARCH_SHRINK,
) -> np.ndarray:
    """Per-group bfloat16 scales minimizing the squared error, [..., K, N] -> [..., K/group, N].

    Candidates are r·max|W_g|/7 and r·(-p)/8, p the group's signed value of largest magnitude
    (so p lands on -8 and all 16 levels are used; such a scale may be negative), for each r in
    `shrink`. r = 1 with /7 is the absmax scale, so the error is never above absmax's.
    """
    *lead, k, n = w.shape
    check_group(k, group, name)
    g = np.asarray(w, np.float32).reshape(*lead, k // group, group, n)
    peak = np.take_along_axis(g, np.abs(g).argmax(axis=-2)[..., None, :], axis=-2)[..., 0, :]
    best = to_bf16(np.abs(peak) / np.float32(INT4_MAX))
    best_err = _group_sq_err(g, best)
    for r in shrink:
        for base in (np.abs(peak) / np.float32(INT4_MAX), -peak / np.float32(-INT4_MIN)):
            cand = to_bf16(np.float32(r) * base)
            err = _group_sq_err(g, cand)
            better = err < best_err
            best, best_err = np.where(better, cand, best), np.where(better, err, best_err)
    return best


def _group_sq_err(g: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Squared int4 error per group of g [..., G, group, N] with scales [..., G, N]."""
    s = scales.astype(np.float32)[..., None, :]
    q = quantize_with_scales(g, s, INT4_MIN, INT4_MAX)
    return ((q * s - g) ** 2).sum(axis=-2)


def int4_scales(
    w: np.ndarray, group: int = GROUP, method: str = "absmax", name: str | None = None
) -> np.ndarray:
    """Group scales by `method`: "absmax" (max|W_g| / 7) or "mse" (`int4_mse_scales`)."""
    if method == "absmax":
        return int4_absmax_scales(w, group, name)
    if method == "mse":
        return int4_mse_scales(w, group, name)
    raise ValueError(f"unknown int4 scale method {method!r}; expected one of {SCALE_METHODS}")


def quantize_int4_with_scales(
    w: np.ndarray, scales: np.ndarray, group: int = GROUP, name: str | None = None
) -> Int4Weight:
    """Quantize [..., K, N] with given bfloat16 group scales [..., K/group, N]."""
    w = _as_float32(w, name)
    *lead, k, n = w.shape
    check_group(k, group, name)
    scales = to_bf16(scales)
    if scales.shape != (*lead, k // group, n):
        raise ValueError(f"scales shape {scales.shape} != {(*lead, k // group, n)}")
    g = w.reshape(*lead, k // group, group, n)
    q = quantize_with_scales(g, scales.astype(np.float32)[..., None, :], INT4_MIN, INT4_MAX)
    return Int4Weight(pack_int4(q.reshape(*lead, k, n), group, name), scales)


def quantize_int4_rtn(
    w: np.ndarray, group: int = GROUP, name: str | None = None, scale_method: str = "absmax"
) -> Int4Weight:
    """Round-to-nearest int4; group scales by `scale_method` (see `int4_scales`)."""
    w = _as_float32(w, name)
    return quantize_int4_with_scales(w, int4_scales(w, group, scale_method, name), group, name)


def dequantize_int4(weight: Int4Weight) -> np.ndarray:
    """Int4Weight -> float32 [..., K, N]."""
    group = weight.group
    q = unpack_int4(weight.packed, group).astype(np.float32)
    *lead, k, n = q.shape
    s = weight.scales.astype(np.float32)[..., :, None, :]
    return (q.reshape(*lead, k // group, group, n) * s).reshape(*lead, k, n)


def unpack_int4_jnp(packed: jnp.ndarray, group: int = GROUP) -> jnp.ndarray:
    """jnp twin of `unpack_int4` (jit-friendly): uint8 [..., N, K/2] -> int8 [..., K, N]."""
    *lead, n, half = packed.shape
    check_group(2 * half, group)
    p = packed.astype(jnp.int8)
    pairs = jnp.stack([jnp.left_shift(p, 4), p], axis=-1) >> 4  # arithmetic: sign-extends
    return jnp.swapaxes(pairs.reshape(*lead, n, 2 * half), -1, -2)


def _dequantize_out_major(packed: jnp.ndarray, scales: jnp.ndarray, dtype) -> jnp.ndarray:
    """[..., N, K] in a 16-bit `dtype`: each byte's two products are rounded and joined into
    one 32-bit word, the little-endian memory of the pair, so that XLA:CPU never interleaves
    single elements (it vectorizes this 1.7x faster than unpack-then-scale)."""
    if jnp.dtype(dtype).itemsize != 2:
        raise ValueError(f"output-major int4 dequantization writes 16-bit values, not {dtype}")
    *lead, n, half = packed.shape
    groups = scales.shape[-2]
    p = packed.astype(jnp.int8)
    s = jnp.swapaxes(scales.astype(jnp.float32), -1, -2)[..., None]  # [..., N, groups, 1]

    def bits(q):  # q * s in `dtype`, as the low 16 bits of a uint32
        w = (q.astype(jnp.float32).reshape(*lead, n, groups, -1) * s).astype(dtype)
        return lax.bitcast_convert_type(w, jnp.uint16).astype(jnp.uint32)

    word = bits(jnp.left_shift(p, 4) >> 4) | (bits(p >> 4) << 16)
    return lax.bitcast_convert_type(word.reshape(*lead, n, half), dtype).reshape(*lead, n, 2 * half)


def dequantize_int4_jnp(
    packed: jnp.ndarray, scales: jnp.ndarray, dtype: jnp.dtype = jnp.float32,
    out_major: bool = False,
) -> jnp.ndarray:
    """jnp twin of `dequantize_int4`: packed [..., N, K/2], scales [..., K/g, N] -> [..., K, N]
    (or [..., N, K] with `out_major`, the storage order: no transpose, for the host CPU).

    The product q * s is exact in float32 (4-bit times 8-bit significands), so the float32
    result equals the numpy one bit for bit and a narrower `dtype` is one rounding of it.
    """
    *lead, n, half = packed.shape
    k, groups = 2 * half, scales.shape[-2]
    if groups <= 0 or k % groups:
        raise ValueError(f"scales {scales.shape} do not split K={k} into whole groups")
    group = k // groups
    if out_major:
        return _dequantize_out_major(packed, scales, dtype)
    q = unpack_int4_jnp(packed, group).astype(jnp.float32)
    s = scales.astype(jnp.float32)[..., :, None, :]
    w = (q.reshape(*lead, groups, group, n) * s).reshape(*lead, k, n)
    return w.astype(dtype)


# --------------------------------------------------------------------------- int8


def int8_absmax_scales(w: np.ndarray) -> np.ndarray:
    """Per-output-channel scales max|W[:, n]| / 127 rounded to bfloat16: [..., K, N] -> [..., N]."""
    return to_bf16(np.abs(w).max(axis=-2) / np.float32(INT8_MAX))


def quantize_int8_with_scales(w: np.ndarray, scales: np.ndarray) -> Int8Weight:
    """Quantize [..., K, N] with given per-output-channel scales [..., N]."""
    scales = to_bf16(scales)
    q = quantize_with_scales(w, scales.astype(np.float32)[..., None, :], -INT8_MAX, INT8_MAX)
    return Int8Weight(q, scales)


def quantize_int8(w: np.ndarray, name: str | None = None) -> Int8Weight:
    """Round-to-nearest symmetric int8 with one absmax scale per output column."""
    w = _as_float32(w, name)
    return quantize_int8_with_scales(w, int8_absmax_scales(w))


def dequantize_int8(weight: Int8Weight) -> np.ndarray:
    """Int8Weight -> float32 [..., K, N]."""
    return weight.q.astype(np.float32) * weight.scales.astype(np.float32)[..., None, :]


def dequantize_int8_jnp(
    q: jnp.ndarray, scales: jnp.ndarray, dtype: jnp.dtype = jnp.float32
) -> jnp.ndarray:
    """jnp twin of `dequantize_int8` (float32 result is bit-identical to numpy's)."""
    w = q.astype(jnp.float32) * scales.astype(jnp.float32)[..., None, :]
    return w.astype(dtype)


def int8_matmul_jnp(x: jnp.ndarray, q: jnp.ndarray, scales: jnp.ndarray) -> jnp.ndarray:
    """x @ (q * s) computed as (x @ q) * s: the per-column scale moves after the matmul."""
    y = jnp.matmul(x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scales.astype(jnp.float32)).astype(x.dtype)


# --------------------------------------------------------------------------- bytes


def int4_bytes(k: int, n: int, group: int = GROUP) -> int:
    """Bytes of an int4 [K, N] weight: packed nibbles plus bfloat16 group scales."""
    check_group(k, group)
    return k * n // 2 + (k // group) * n * 2


def int8_bytes(k: int, n: int) -> int:
    """Bytes of an int8 [K, N] weight: int8 values plus bfloat16 per-column scales."""
    return k * n + n * 2


def dense_bytes(k: int, n: int, dtype: str | np.dtype | type = "bfloat16") -> int:
    """Bytes of an unquantized [K, N] weight of `dtype`."""
    return k * n * np.dtype(dtype).itemsize
