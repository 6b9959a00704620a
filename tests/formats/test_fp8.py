"""Block-wise FP8 (DeepSeek-V3 style) source weights: config parsing, dequantization against an
independent torch reference (quantized with torch.float8_e4m3fn, scale_inv = block absmax / 448,
written with safetensors.torch), e4m3's error bound, bfloat16 output, tensor names, errors."""

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from strata_jax.formats import fp8
from strata_jax.formats.fp8 import Fp8Format, Fp8FormatError

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3_MAX = 448.0
DEEPSEEK_V3 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
SHAPES = [(300, 200), (128, 256), (64, 40), (129, 385)]
NAME = "model.layers.3.mlp.experts.7.down_proj.weight"


# --------------------------------------------------------------------------- torch reference


def _weights(shape: tuple[int, ...], block: tuple[int, int], seed: int) -> torch.Tensor:
    """Heavy-tailed float32 weights whose magnitude varies by 1e5 from block to block."""
    rng = np.random.default_rng(seed)
    w = rng.standard_t(4, size=shape)
    *lead, rows, cols = shape
    grid = (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    w = w * _expand(10.0 ** rng.uniform(-3, 2, size=grid), block, shape)
    return torch.from_numpy(w.astype(np.float32))


def _expand(s: np.ndarray | torch.Tensor, block: tuple[int, int], shape: tuple[int, ...]):
    """Each element's block scale, the shape of the weight (works for numpy and torch)."""
    rows, cols = shape[-2:]
    if isinstance(s, torch.Tensor):
        s = s.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    else:
        s = np.repeat(np.repeat(s, block[0], axis=-2), block[1], axis=-1)
    return s[..., :rows, :cols]


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """torch e4m3 block quantization: (w_fp8, scale_inv = block absmax / 448, float32)."""
    *lead, rows, cols = w.shape
    nr, nc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.zeros(*lead, nr * block[0], nc * block[1])
    padded[..., :rows, :cols] = w
    tiles = padded.reshape(*lead, nr, block[0], nc, block[1])
    scale_inv = (tiles.abs().amax(dim=(-3, -1)) / E4M3_MAX).to(torch.float32)
    q = (w / _expand(scale_inv, block, w.shape)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale_inv


def _reference(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> np.ndarray:
    """torch's dequantization, float32: w_fp8.to(float32) * scale_inv.repeat_interleave(...)."""
    return (q.to(torch.float32) * _expand(scale_inv, block, q.shape)).numpy()


def _np(q: torch.Tensor, scale_inv: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The e4m3 weight (as ml_dtypes) and float32 scales as numpy arrays."""
    return q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), scale_inv.numpy()


def _case(shape, block=(128, 128), seed=0):
    w = _weights(shape, block, seed)
    q, s = _quantize(w, block)
    return w, q, s


# --------------------------------------------------------------------------- Fp8Format


def test_from_hf_deepseek_v3():
    f = Fp8Format.from_hf(DEEPSEEK_V3)
    assert f == Fp8Format(block=(128, 128))
    assert (f.fmt, f.activation_scheme, f.scale_fmt) == ("e4m3", "dynamic", "float")


def test_from_hf_optional_fields():
    qc = {"quant_method": "fp8", "weight_block_size": [128, 64], "scale_fmt": "ue8m0",
          "activation_scheme": "DYNAMIC", "ignored_layers": ["lm_head"], "dequantize": False}
    f = Fp8Format.from_hf(qc)
    assert f.block == (128, 64) and f.scale_fmt == "ue8m0"
    assert f.fmt == "e4m3" and f.activation_scheme == "dynamic"
    assert f.modules_to_not_convert == ("lm_head",)


@pytest.mark.parametrize("change, field", [
    ({"quant_method": "awq"}, "quant_method"),
    ({"quant_method": None}, "quant_method"),
    ({"fmt": "e5m2"}, "fmt"),
    ({"activation_scheme": "static"}, "activation_scheme"),
    ({"weight_block_size": None}, "weight_block_size"),
    ({"weight_block_size": [128]}, "weight_block_size"),
    ({"weight_block_size": [128, 0]}, "weight_block_size"),
    ({"weight_block_size": [128.0, 128]}, "weight_block_size"),
    ({"weight_block_size": "128x128"}, "weight_block_size"),
    ({"scale_fmt": "mx"}, "scale_fmt"),
    ({"expert_dtype": "fp4"}, "expert_dtype"),
    ({"kv_cache_scheme": "fp8"}, "kv_cache_scheme"),
])
def test_from_hf_refuses(change, field):
    qc = {**DEEPSEEK_V3, **change}
    with pytest.raises(Fp8FormatError, match=f"quantization_config.{field}"):
        Fp8Format.from_hf(qc)


def test_from_hf_refuses_missing_block_size():
    qc = {k: v for k, v in DEEPSEEK_V3.items() if k != "weight_block_size"}
    with pytest.raises(Fp8FormatError, match="weight_block_size is missing"):
        Fp8Format.from_hf(qc)


def test_from_hf_refuses_other_methods():
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    with pytest.raises(Fp8FormatError, match="quantization_config"):
        Fp8Format.from_hf(gptq)
    with pytest.raises(Fp8FormatError, match="must be an object"):
        Fp8Format.from_hf([128, 128])


def test_format_is_frozen_and_checked():
    f = Fp8Format(block=(128, 128))
    with pytest.raises(AttributeError):
        f.block = (64, 64)
    with pytest.raises(Fp8FormatError, match="weight_block_size"):
        Fp8Format(block=(128, -1))


# --------------------------------------------------------------------------- dequantization


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_torch_exactly(shape):
    _, q, s = _case(shape)
    got = fp8.dequantize_block_fp8(*_np(q, s), (128, 128), np.float32)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, _reference(q, s, (128, 128)))


@pytest.mark.parametrize("shape", SHAPES)
def test_within_e4m3_rounding(shape):
    """Round-to-nearest e4m3 (3 mantissa bits) of v = x / s errs by at most 2^-4 |v| where v is
    normal (|v| >= 2^-6) and by 2^-10 (half the subnormal step 2^-9) below: so
    |deq - x| <= 2^-4 |x| + 2^-10 s per element, s its block's scale_inv, plus float32
    roundings of x / s and q * s (a relative 2^-16 margin covers them). In particular the error
    is at most 2^-4 of the block absmax (= 448 s), tighter than 2^-3."""
    w, q, s = _case(shape, seed=1)
    got = fp8.dequantize_block_fp8(*_np(q, s), (128, 128))
    x, scale = w.numpy().astype(np.float64), _expand(s.numpy(), (128, 128), shape)
    err = np.abs(got - x)
    assert np.all(err <= (2.0**-4 * np.abs(x) + 2.0**-10 * scale) * (1 + 2.0**-16))
    assert np.all(err <= 2.0**-4 * E4M3_MAX * scale)
    assert err.max() > 0  # quantization did happen


@pytest.mark.parametrize("shape", SHAPES)
def test_bfloat16_is_float32_rounded(shape):
    _, q, s = _case(shape, seed=2)
    f32 = fp8.dequantize_block_fp8(*_np(q, s), (128, 128), np.float32)
    bf16 = fp8.dequantize_block_fp8(*_np(q, s), (128, 128), "bfloat16")
    assert bf16.dtype == BF16
    np.testing.assert_array_equal(bf16.view(np.uint16), f32.astype(BF16).view(np.uint16))
    torch_bf16 = torch.from_numpy(_reference(q, s, (128, 128))).to(torch.bfloat16)
    np.testing.assert_array_equal(bf16.view(np.uint16), torch_bf16.view(torch.uint16).numpy())


def test_uint8_bytes_equal_float8():
    _, q, s = _case((300, 200), seed=3)
    w8, s32 = _np(q, s)
    a = fp8.dequantize_block_fp8(w8, s32, (128, 128))
    b = fp8.dequantize_block_fp8(w8.view(np.uint8), s32, (128, 128))
    np.testing.assert_array_equal(a, b)


def test_non_square_blocks_and_leading_axes():
    block = (64, 32)
    _, q, s = _case((3, 150, 70), block=block, seed=4)
    got = fp8.dequantize_block_fp8(*_np(q, s), block)
    np.testing.assert_array_equal(got, _reference(q, s, block))
    one = fp8.dequantize_block_fp8(*_np(q[1], s[1]), block)
    np.testing.assert_array_equal(got[1], one)


def test_e8m0_scales_equal_float32():
    _, q, s = _case((300, 200), seed=5)
    s = torch.exp2(torch.ceil(torch.log2(s)))  # ue8m0: powers of two
    w8, s32 = _np(q, s)
    e8m0 = s32.astype(ml_dtypes.float8_e8m0fnu)
    got = fp8.dequantize_block_fp8(w8, e8m0, (128, 128))
    np.testing.assert_array_equal(got, fp8.dequantize_block_fp8(w8, s32, (128, 128)))


@pytest.mark.parametrize("scale_shape", [(2, 2), (3, 1), (3, 2, 1), (2, 3)])
def test_scale_shape_mismatch(scale_shape):
    _, q, s = _case((300, 200), seed=6)
    w8, _ = _np(q, s)
    bad = np.full(scale_shape, 0.01, np.float32)
    with pytest.raises(ValueError, match=rf"{NAME}: weight_scale_inv has shape.*needs \(3, 2\)"):
        fp8.dequantize_block_fp8(w8, bad, (128, 128), name=NAME)


def test_bad_dtypes_and_values():
    _, q, s = _case((64, 40), seed=7)
    w8, s32 = _np(q, s)
    with pytest.raises(ValueError, match=f"{NAME}: FP8 weight must be float8_e4m3fn"):
        fp8.dequantize_block_fp8(w8.astype(np.float32), s32, (128, 128), name=NAME)
    with pytest.raises(ValueError, match=f"{NAME}: weight_scale_inv must be float32"):
        fp8.dequantize_block_fp8(w8, s32.astype(np.float16), (128, 128), name=NAME)
    with pytest.raises(ValueError, match=f"{NAME}: out_dtype must be float32 or bfloat16"):
        fp8.dequantize_block_fp8(w8, s32, (128, 128), np.float16, name=NAME)
    with pytest.raises(ValueError, match=f"{NAME}: FP8 weight must be \\[..., rows, cols\\]"):
        fp8.dequantize_block_fp8(w8[0], s32[0], (128, 128), name=NAME)
    nan = w8.view(np.uint8).copy()
    nan[5, 7] = 0x7F  # e4m3fn's NaN
    with pytest.raises(ValueError, match=f"{NAME}: non-finite values in rows 0:64"):
        fp8.dequantize_block_fp8(nan, s32, (128, 128), name=NAME)


# --------------------------------------------------------------------------- names and files


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def _source(path: Path, tensors: dict[str, torch.Tensor], fmt: Fp8Format | None):
    """The converter's reader over a one-file checkpoint of `tensors` (the one safetensors
    reader: `tools/hf_convert.TensorSource`)."""
    from strata_jax.tools.hf_convert import TensorSource

    path.mkdir()
    _write(path / "model.safetensors", tensors)
    return TensorSource(path, fmt)


def test_tensor_names(tmp_path):
    _, q, s = _case((64, 40))
    norm = torch.ones(40, dtype=torch.bfloat16) * 1.5
    source = _source(tmp_path / "ck", {NAME: q, fp8.scale_name(NAME): s,
                                       "model.norm.weight": norm}, Fp8Format(block=(128, 128)))
    assert fp8.scale_name(NAME) == NAME + "_scale_inv"
    assert source.read(NAME).dtype == np.float32  # an FP8 weight: read dequantized
    assert source.read("model.norm.weight").dtype == BF16  # no scale: as stored
    assert fp8.is_scale_name(fp8.scale_name(NAME)) and not fp8.is_scale_name(NAME)


@pytest.mark.parametrize("shape", SHAPES)
def test_read_from_safetensors(tmp_path, shape):
    w, q, s = _case(shape, seed=8)
    other = "model.layers.3.mlp.experts.8.down_proj.weight"
    source = _source(tmp_path / "ck", {
        NAME: q, fp8.scale_name(NAME): s, other: q.flip(0), fp8.scale_name(other): s.flip(0) * 2,
    }, Fp8Format.from_hf(DEEPSEEK_V3))
    got = source.read(NAME)
    np.testing.assert_array_equal(got, _reference(q, s, (128, 128)))
    np.testing.assert_array_equal(source.read(other),
                                  _reference(q.flip(0), s.flip(0) * 2, (128, 128)))


def test_read_errors(tmp_path):
    _, q, s = _case((300, 200), seed=10)
    fmt = Fp8Format(block=(128, 128))
    bad = _source(tmp_path / "bad", {NAME: q, fp8.scale_name(NAME): s[:2]}, fmt)
    with pytest.raises(ValueError, match=r"_scale_inv' in model.safetensors has shape \(2, 2\)"):
        bad.read(NAME)
    bf = _source(tmp_path / "bf16", {NAME: q.to(torch.bfloat16), fp8.scale_name(NAME): s}, fmt)
    with pytest.raises(ValueError, match=f"tensor '{NAME}' in model.safetensors has dtype BF16"):
        bf.read(NAME)
    alone = _source(tmp_path / "alone", {NAME: q}, fmt)
    with pytest.raises(ValueError, match="block scales .*_scale_inv' are missing"):
        alone.read(NAME)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"\xff" * 64)
    from strata_jax.tools.hf_convert import TensorSource

    with pytest.raises(ValueError, match="not a safetensors file"):
        TensorSource(junk, fmt)
