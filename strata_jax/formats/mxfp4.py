"""MXFP4 source experts (GPT-OSS as released), dequantized on the host, exactly.

GPT-OSS ships each expert projection as two safetensors tensors (the OCP microscaling format,
32 values a block):

    <name>_blocks   uint8  [experts, out, in / 32, 16]   two FP4 (e2m1) codes a byte, the low
                                                          nibble first
    <name>_scales   uint8  [experts, out, in / 32]       one E8M0 exponent a block (bias 127)

The value of code c in a block with scale s is `E2M1[c] * 2 ** (s - 127)`; a row of `out` holds
its `in` values block after block. This is the layout transformers dequantizes in
`integrations/mxfp4.py` (`convert_moe_packed_tensors`, which also transposes each expert to
[in, out], the layout of GPT-OSS's unquantized `gate_up_proj` / `down_proj`).

Every E2M1 value has at most two significant bits, so each dequantized value is exact in
bfloat16 (and float32), subnormals included: the import is lossless, whatever the output dtype.
A NaN scale (255) or a value past float32's range (the largest codes at a scale of 2 ** 126
and up) is refused. Nothing here needs JAX or torch; `dequantize_mxfp4` works one expert at a
time into its output, so memory stays one expert.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 32
"""Values per block (one scale each)."""
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
E8M0_BIAS, E8M0_NAN = 127, 255
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
"""The value of each FP4 (e2m1) code: sign bit 3, exponent bits 2-1, mantissa bit 0."""
OUT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


class Mxfp4Error(ValueError):
    """MXFP4 tensors this module cannot dequantize, naming the tensor at fault."""


def check_mxfp4(blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...], name: str
                ) -> tuple[int, int, int]:
    """(experts, out, in) of a `name`_blocks / `name`_scales pair, or Mxfp4Error."""
    if len(blocks_shape) != 4 or blocks_shape[-1] != BLOCK // 2:
        raise Mxfp4Error(f"{name}{BLOCKS_SUFFIX}: shape {blocks_shape}, expected [experts, "
                         f"out, in / {BLOCK}, {BLOCK // 2}] bytes")
    if tuple(scales_shape) != tuple(blocks_shape[:-1]):
        raise Mxfp4Error(f"{name}{SCALES_SUFFIX}: shape {tuple(scales_shape)}, expected "
                         f"{tuple(blocks_shape[:-1])} (one scale a block of {name}{BLOCKS_SUFFIX})")
    experts, out, groups, _ = blocks_shape
    return experts, out, groups * BLOCK


def dequantize_expert(blocks: np.ndarray, scales: np.ndarray, out_dtype: str = "bfloat16",
                      name: str = "mxfp4", expert: int | None = None) -> np.ndarray:
    """One expert's [in, out] matrix in `out_dtype` from its blocks [out, in / 32, 16] and
    scales [out, in / 32] (transposed as transformers dequantizes it: the layout of GPT-OSS's
    float `gate_up_proj` / `down_proj`). Exact (module docstring); `name` and `expert` name
    the tensor in errors."""
    where = "" if expert is None else f" (expert {expert})"
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise Mxfp4Error(f"{name}{where}: blocks and scales must be uint8, got {blocks.dtype} "
                         f"and {scales.dtype}")
    check_mxfp4((1, *blocks.shape), (1, *scales.shape), name)
    if (scales == E8M0_NAN).any():
        out, group = np.argwhere(scales == E8M0_NAN)[0]
        raise Mxfp4Error(f"{name}{SCALES_SUFFIX}{where}: the NaN scale (255) at row {out}, "
                         f"block {group}")
    codes = np.empty((*blocks.shape[:-1], BLOCK), np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    exponent = scales.astype(np.int32) - E8M0_BIAS
    with np.errstate(over="ignore"):  # an overflow is refused below, by name
        values = np.ldexp(E2M1[codes], exponent[..., None])  # float32: exact
    if np.isinf(values).any():
        out, group, _ = np.argwhere(np.isinf(values))[0]
        raise Mxfp4Error(f"{name}{SCALES_SUFFIX}{where}: scale 2 ** {exponent[out, group]} at "
                         f"row {out}, block {group} takes a value past float32's range")
    matrix = values.reshape(blocks.shape[0], -1).T
    return np.ascontiguousarray(matrix.astype(OUT_DTYPES[out_dtype]))


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, out_dtype: str = "bfloat16",
                     name: str = "mxfp4") -> np.ndarray:
    """Every expert's [experts, in, out] matrix from blocks [experts, out, in / 32, 16] and
    scales [experts, out, in / 32], one expert at a time (`dequantize_expert`)."""
    experts, out, inputs = check_mxfp4(blocks.shape, scales.shape, name)
    result = np.empty((experts, inputs, out), OUT_DTYPES[out_dtype])
    for e in range(experts):
        result[e] = dequantize_expert(blocks[e], scales[e], out_dtype, name, e)
    return result
