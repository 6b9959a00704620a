"""Block-wise FP8 source weights (DeepSeek-V3 style), dequantized on the host one tensor at a time.

DeepSeek-V3 and its descendants ship each quantized linear weight as two safetensors tensors:

    <name>             float8_e4m3fn  [rows, cols]  (as stored: a torch Linear's [out, in])
    <name>_scale_inv   float32        [ceil(rows / br), ceil(cols / bc)]

with `(br, bc)` the config's `quantization_config.weight_block_size` (`[128, 128]`). The real
value is `float32(w[i, j]) * scale_inv[i // br, j // bc]`; blocks at the bottom and right edges
may be partial. This is the convention of transformers' `integrations/finegrained_fp8.py`
(`FP8Linear.__init__` sizes the scale grid with ceil division, `_dequantize_fp8_weight` expands
it over rows with `repeat_interleave` and crops the partial edge blocks, `Fp8Dequantize.
_dequantize_one` multiplies in float32 and then casts to the output dtype) and of DeepSeek's own
`weight_dequant` kernel. The product is one correctly rounded float32 multiply, so the float32
result equals torch's `w.to(float32) * scale` bit for bit; bfloat16 output is that float32
result rounded to nearest even.

Nothing here needs JAX or torch: the converter's reader (`tools/hf_convert.TensorSource`) takes
the two tensors' bytes straight from the safetensors file (safetensors' numpy framework cannot
load float8: numpy has no such dtype) and `dequantize_block_fp8` works block-row by block-row
into the output array, so memory stays one tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

SCALE_SUFFIX = "_scale_inv"
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
OUT_DTYPES = {"float32": F32, "bfloat16": BF16}
_E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
"""float32 value of each e4m3fn byte (0x7f and 0xff are NaN): an exact lookup table."""

FMTS = ("e4m3",)
ACTIVATION_SCHEMES = ("dynamic",)
SCALE_FMTS = ("float", "ue8m0")
EXPERT_DTYPES = ("fp8",)
KNOWN_KEYS = frozenset({
    "quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt",
    "expert_dtype", "modules_to_not_convert", "ignored_layers", "modules_to_convert",
    "dequantize",
})
"""`quantization_config` keys `Fp8Format.from_hf` understands; any other key is refused."""


class Fp8FormatError(ValueError):
    """A `quantization_config` this module cannot dequantize, naming the offending field."""


# --------------------------------------------------------------------------- the format


@dataclass(frozen=True, kw_only=True)
class Fp8Format:
    """A block-wise FP8 weight format, as read from a HF `quantization_config` (`from_hf`)."""

    block: tuple[int, int]
    """`weight_block_size`: rows and columns (of the weight as stored) one scale covers."""

    fmt: str = "e4m3"
    """Element format of the weights; only "e4m3" (torch.float8_e4m3fn, max 448)."""

    activation_scheme: str = "dynamic"
    """How the source quantizes activations at run time; only "dynamic" (no stored activation
    scales, so dequantizing the weights loses nothing of the model)."""

    scale_fmt: str = "float"
    """How the scales were chosen: "float" (any float32) or "ue8m0" (powers of two, still
    stored as float32 or as float8_e8m0fnu); both dequantize as `w * scale_inv`."""

    modules_to_not_convert: tuple[str, ...] = ()
    """Module names the source left unquantized (informational: a tensor is dequantized
    exactly when it has a `<name>_scale_inv` companion, see `is_fp8_weight`)."""

    def __post_init__(self) -> None:
        _check_block(self.block)
        _check_choice("fmt", self.fmt, FMTS)
        _check_choice("activation_scheme", self.activation_scheme, ACTIVATION_SCHEMES)
        _check_choice("scale_fmt", self.scale_fmt, SCALE_FMTS)

    @classmethod
    def from_hf(cls, qc: Mapping[str, Any]) -> Fp8Format:
        """The format of a HF `quantization_config` dict; Fp8FormatError naming the field
        unless it is block-wise e4m3 FP8 with dynamic activations. `fmt` and
        `activation_scheme` default as transformers does ("e4m3", "dynamic")."""
        if not isinstance(qc, Mapping):
            raise Fp8FormatError(f"quantization_config must be an object, got {type(qc).__name__}")
        _check_keys(qc)
        _check_choice("quant_method", qc.get("quant_method"), ("fp8",))
        _check_choice("expert_dtype", qc.get("expert_dtype", "fp8"), EXPERT_DTYPES)
        if qc.get("weight_block_size") is None:
            raise Fp8FormatError(
                "quantization_config.weight_block_size is missing: only block-wise FP8 "
                "(e.g. [128, 128]) is supported, not per-tensor scales"
            )
        skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
        return cls(
            block=_as_block(qc["weight_block_size"]),
            fmt=qc.get("fmt", "e4m3"),
            activation_scheme=str(qc.get("activation_scheme", "dynamic")).lower(),
            scale_fmt=qc.get("scale_fmt", "float"),
            modules_to_not_convert=tuple(str(m) for m in skip),
        )


def _check_keys(qc: Mapping[str, Any]) -> None:
    unknown = sorted(set(qc) - KNOWN_KEYS)
    if unknown:
        raise Fp8FormatError(
            f"quantization_config.{unknown[0]} is not understood (FP8 fields known: "
            f"{', '.join(sorted(KNOWN_KEYS))}); refusing rather than guessing its meaning"
        )


def _check_choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise Fp8FormatError(
            f"quantization_config.{field} = {value!r} is not supported; supported: "
            f"{', '.join(repr(a) for a in allowed)}"
        )


def _as_block(value: Any) -> tuple[int, int]:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise Fp8FormatError(
            f"quantization_config.weight_block_size must be two integers, got {value!r}"
        )
    return tuple(value)  # type: ignore[return-value]  # checked by _check_block


def _check_block(block: Any) -> None:
    ok = (
        isinstance(block, tuple) and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    )
    if not ok:
        raise Fp8FormatError(
            f"quantization_config.weight_block_size must be two positive integers, got {block!r}"
        )


# --------------------------------------------------------------------------- tensor names


def scale_name(name: str) -> str:
    """The companion scale tensor of weight `name` (`x.weight` -> `x.weight_scale_inv`)."""
    return name + SCALE_SUFFIX


def is_scale_name(name: str) -> bool:
    """Whether `name` is itself a block-scale tensor (`..._scale_inv`)."""
    return name.endswith(SCALE_SUFFIX)


# --------------------------------------------------------------------------- dequantization


def dequantize_block_fp8(
    weight: np.ndarray,
    scale_inv: np.ndarray,
    block: tuple[int, int],
    out_dtype: Any = np.float32,
    name: str | None = None,
) -> np.ndarray:
    """Dequantize `weight` e4m3 [..., rows, cols] (or its uint8 bytes) with float32 (or e8m0)
    `scale_inv` [..., ceil(rows / block[0]), ceil(cols / block[1])] to `out_dtype` (float32 or
    bfloat16): float32(w) * scale in float32, then one cast. ValueError naming `name` on a
    wrong dtype or shape, or a non-finite result."""
    where = f"{name}: " if name else ""
    _check_block(tuple(block))
    codes = _as_codes(weight, where)
    scale = _as_scale(scale_inv, where)
    _check_shapes(codes.shape, scale.shape, block, where)
    out = np.empty(codes.shape, _out_dtype(out_dtype, where))
    rows, cols = codes.shape[-2:]
    for bi in range(scale.shape[-2]):
        lo, hi = bi * block[0], min(rows, (bi + 1) * block[0])
        col_scale = np.repeat(scale[..., bi, :], block[1], axis=-1)[..., None, :cols]
        chunk = np.take(_E4M3_TO_F32, codes[..., lo:hi, :])
        chunk *= col_scale
        if not np.isfinite(chunk).all():
            raise ValueError(f"{where}non-finite values in rows {lo}:{hi} (NaN codes or scales)")
        out[..., lo:hi, :] = chunk
    return out


def _as_codes(weight: np.ndarray, where: str) -> np.ndarray:
    """The weight's raw e4m3 bytes as uint8."""
    weight = np.asarray(weight)
    if weight.dtype not in (E4M3, np.dtype(np.uint8)):
        raise ValueError(f"{where}FP8 weight must be float8_e4m3fn or uint8, got {weight.dtype}")
    if weight.ndim < 2:
        raise ValueError(f"{where}FP8 weight must be [..., rows, cols], got shape {weight.shape}")
    return weight.view(np.uint8)


def _as_scale(scale_inv: np.ndarray, where: str) -> np.ndarray:
    scale = np.asarray(scale_inv)
    if scale.dtype not in (F32, E8M0):
        raise ValueError(
            f"{where}weight_scale_inv must be float32 (or float8_e8m0fnu), got {scale.dtype}"
        )
    return scale.astype(np.float32, copy=False)  # e8m0 -> float32 is exact


def _check_shapes(
    shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int], where: str
) -> None:
    *lead, rows, cols = shape
    want = (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_shape) != want:
        raise ValueError(
            f"{where}weight_scale_inv has shape {tuple(scale_shape)}, but a weight of shape "
            f"{tuple(shape)} in {block[0]}x{block[1]} blocks needs {want}"
        )


def _out_dtype(out_dtype: Any, where: str) -> np.dtype:
    try:
        dt = OUT_DTYPES.get(out_dtype) if isinstance(out_dtype, str) else np.dtype(out_dtype)
    except TypeError:
        dt = None
    if dt not in (F32, BF16):
        raise ValueError(f"{where}out_dtype must be float32 or bfloat16, got {out_dtype!r}")
    return dt


# --------------------------------------------------------------------------- safetensors


SAFETENSORS_DTYPES = {"F8_E4M3": E4M3, "F32": F32, "F8_E8M0": E8M0}
"""The safetensors dtypes an FP8 weight and its scale may have, as numpy dtypes (the reader is
`tools/hf_convert.TensorSource`)."""
