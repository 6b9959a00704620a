"""GPT-OSS's MXFP4 experts dequantized exactly: against transformers' own dequantization
(`integrations/mxfp4.convert_moe_packed_tensors`) bit for bit, and against a float64 decoding
of each code's sign, exponent and mantissa bits."""

from __future__ import annotations

import numpy as np
import pytest

from strata_jax.formats import mxfp4

torch = pytest.importorskip("torch")
hf_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def _random(experts=3, out=6, groups=4, seed=0):
    """Random blocks and scales over the normal range and both ends of it."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(experts, out, groups, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, size=(experts, out, groups), dtype=np.uint8)
    scales[0, 0, :2] = (0, 1)  # the smallest scales: bfloat16 subnormals
    scales[-1, -1, -1] = 252  # the largest whose values all fit float32
    return blocks, scales


def _float64(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[experts, in, out] decoded from the bits: e2m1 = sign, 2 exponent bits (bias 1), one
    mantissa bit (exponent 0: subnormal, 0.5 x mantissa)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    sign = np.where(codes & 0x8, -1.0, 1.0)
    exp, man = (codes >> 1) & 0x3, codes & 0x1
    mag = np.where(exp == 0, 0.5 * man, (1.0 + 0.5 * man) * 2.0 ** (exp.astype(np.float64) - 1))
    values = sign * mag * 2.0 ** (scales.astype(np.float64) - 127)[..., None]
    return values.reshape(*blocks.shape[:2], -1).transpose(0, 2, 1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dequantized_experts_equal_transformers_and_the_bits(dtype):
    blocks, scales = _random()
    got = mxfp4.dequantize_mxfp4(blocks, scales, dtype, "gate_up_proj")
    assert got.shape == (3, 4 * 32, 6) and got.dtype == mxfp4.OUT_DTYPES[dtype]
    want = hf_mxfp4.convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales),
        dtype=getattr(torch, dtype)).float().numpy()
    np.testing.assert_array_equal(got.astype(np.float32), want)
    exact = _float64(blocks, scales)
    assert np.abs(exact).max() > 1e37 and 0 < np.abs(exact[exact != 0]).min() < 1e-38
    np.testing.assert_array_equal(got.astype(np.float64), exact)  # lossless, subnormals too


def test_bad_tensors_are_refused_by_name():
    blocks, scales = _random()
    with pytest.raises(mxfp4.Mxfp4Error, match="down_proj_scales: shape"):
        mxfp4.dequantize_mxfp4(blocks, scales[:, :, :2], name="down_proj")
    with pytest.raises(mxfp4.Mxfp4Error, match=r"down_proj_blocks: shape .* expected"):
        mxfp4.dequantize_mxfp4(blocks[..., :8], scales, name="down_proj")
    nan = scales.copy()
    nan[1, 2, 3] = 255
    with pytest.raises(mxfp4.Mxfp4Error, match=r"down_proj_scales \(expert 1\): the NaN scale "
                                               r"\(255\) at row 2, block 3"):
        mxfp4.dequantize_mxfp4(blocks, nan, name="down_proj")
    big = scales.copy()
    big[0, 0, 0], blocks[0, 0, 0, 0] = 254, 0x07  # 6 x 2 ** 127
    with pytest.raises(mxfp4.Mxfp4Error, match="past float32's range"):
        mxfp4.dequantize_mxfp4(blocks, big, name="down_proj")
