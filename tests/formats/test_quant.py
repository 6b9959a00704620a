"""int4 / int8 formats: packing layout, error bounds, numpy == jnp, validation, byte counts."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_jax.formats import quant as Q

BF16 = np.dtype(ml_dtypes.bfloat16)
SETTINGS = settings(max_examples=30, deadline=None)
shapes = st.tuples(st.sampled_from([128, 256, 384, 512]), st.integers(1, 64))
# jnp checks use few shapes so compiled computations are reused across examples
jnp_shapes = st.tuples(st.sampled_from([128, 512]), st.sampled_from([8, 64]))
seeds = st.integers(0, 2**32 - 1)
magnitudes = st.sampled_from([1e-4, 0.02, 1.0, 300.0])


def _weights(seed: int, k: int, n: int, scale: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_t(4, size=(k, n)) * scale
    return w.astype(np.float32)


def _group_scales(w: Q.Int4Weight) -> np.ndarray:
    """Each element's scale, [K, N] float32."""
    return np.repeat(w.scales.astype(np.float32), w.group, axis=-2)


# --------------------------------------------------------------------------- int4 layout


@SETTINGS
@given(shape=shapes, seed=seeds)
def test_pack_unpack_round_trip(shape, seed):
    q = np.random.default_rng(seed).integers(-8, 8, size=shape).astype(np.int8)
    packed = Q.pack_int4(q)
    assert packed.dtype == np.uint8 and packed.shape == (shape[1], shape[0] // 2)
    np.testing.assert_array_equal(Q.unpack_int4(packed), q)


def test_packed_layout_by_hand():
    q = np.zeros((256, 2), np.int8)
    q[0, 0], q[1, 0] = -8, 7  # K pair 0 of column 0: low nibble 0x8, high nibble 0x7
    q[128 + 10, 1], q[128 + 11, 1] = 3, -1  # pair 69 of column 1: low 0x3, high 0xF
    packed = Q.pack_int4(q)
    assert packed[0, 0] == 0x78
    assert packed[1, 69] == 0xF3
    assert packed[0, 1] == packed[1, 0] == 0x00  # zeros elsewhere


def test_packed_layout_is_the_memory_of_an_int4_array():
    """The bytes the Hopper kernel sees as int4 [N, K] (little-endian nibbles)."""
    q = np.random.default_rng(7).integers(-8, 8, size=(384, 5)).astype(np.int8)
    packed = Q.pack_int4(q)
    as_int4 = jax.lax.bitcast_convert_type(jnp.asarray(packed), jnp.int4).reshape(5, 384)
    np.testing.assert_array_equal(np.asarray(as_int4.astype(jnp.int8)), q.T)


def test_pack_rejects_out_of_range_values():
    q = np.zeros((128, 4), np.int8)
    q[3, 2] = 8
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        Q.pack_int4(q)


@pytest.mark.parametrize("k", [64, 100, 200, 130])
def test_k_not_multiple_of_group_is_rejected(k):
    w = np.random.default_rng(k).normal(size=(k, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=rf"K={k}.*group size 128"):
        Q.quantize_int4_rtn(w)
    with pytest.raises(ValueError, match=r"^layers\.3\.experts\.w2: "):
        Q.quantize_int4_rtn(w, name="layers.3.experts.w2")
    with pytest.raises(ValueError, match=rf"K={k}"):
        Q.int4_bytes(k, 8)


def test_non_finite_weights_are_rejected():
    w = np.random.default_rng(0).normal(size=(128, 4)).astype(np.float32)
    w[5, 1] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        Q.quantize_int4_rtn(w)
    with pytest.raises(ValueError, match="non-finite"):
        Q.quantize_int8(w)


# --------------------------------------------------------------------------- int4 RTN


@SETTINGS
@given(shape=shapes, seed=seeds, scale=magnitudes)
def test_int4_rtn_error_within_half_step(shape, seed, scale):
    w = _weights(seed, *shape, scale)
    qw = Q.quantize_int4_rtn(w)
    assert qw.packed.dtype == np.uint8 and qw.scales.dtype == BF16
    assert qw.scales.shape == (shape[0] // 128, shape[1]) and qw.shape == shape
    s = _group_scales(qw)
    err = np.abs(Q.dequantize_int4(qw) - w)
    assert np.all(err <= s * (0.5 + 1e-6))
    # the scale is max|W_group| / 7 in bfloat16
    absmax = np.abs(w).reshape(-1, 128, shape[1]).max(axis=1)
    np.testing.assert_array_equal(qw.scales, (absmax / 7).astype(BF16))


_dequant_int4 = jax.jit(Q.dequantize_int4_jnp, static_argnums=(2, 3))
_unpack_int4 = jax.jit(Q.unpack_int4_jnp)


@SETTINGS
@given(shape=jnp_shapes, seed=seeds, scale=magnitudes)
def test_int4_jnp_dequant_matches_numpy_exactly(shape, seed, scale):
    qw = Q.quantize_int4_rtn(_weights(seed, *shape, scale))
    ref = Q.dequantize_int4(qw)
    packed, scales = jnp.asarray(qw.packed), jnp.asarray(qw.scales)
    np.testing.assert_array_equal(np.asarray(_unpack_int4(packed)), Q.unpack_int4(qw.packed))
    f32 = _dequant_int4(packed, scales, jnp.float32)
    assert f32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(f32), ref)
    bf16 = _dequant_int4(packed, scales, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(bf16), ref.astype(BF16))
    out_major = _dequant_int4(packed, scales, jnp.bfloat16, True)  # storage order, [N, K]
    np.testing.assert_array_equal(np.asarray(out_major), ref.T.astype(BF16))


def test_int4_dequant_is_exact_wrt_stored_scales():
    w = _weights(3, 256, 32, 0.02)
    qw = Q.quantize_int4_rtn(w)
    again = Q.quantize_int4_with_scales(Q.dequantize_int4(qw), qw.scales)
    np.testing.assert_array_equal(again.packed, qw.packed)


@settings(max_examples=10, deadline=None)
@given(shape=shapes, seed=seeds, scale=magnitudes)
def test_int4_mse_scales_never_worse_than_absmax(shape, seed, scale):
    w = _weights(seed, *shape, scale)
    absmax, mse = Q.quantize_int4_rtn(w), Q.quantize_int4_rtn(w, scale_method="mse")
    assert mse.packed.shape == absmax.packed.shape and mse.scales.dtype == BF16

    def group_sq_err(qw):
        return ((Q.dequantize_int4(qw) - w) ** 2).reshape(-1, 128, shape[1]).sum(axis=1)

    assert np.all(group_sq_err(mse) <= group_sq_err(absmax))
    again = Q.quantize_int4_with_scales(Q.dequantize_int4(mse), mse.scales)
    np.testing.assert_array_equal(again.packed, mse.packed)


def test_int4_mse_scales_reduce_error_and_may_be_negative():
    w = _weights(11, 512, 64, 0.02)
    absmax, mse = Q.quantize_int4_rtn(w), Q.quantize_int4_rtn(w, scale_method="mse")
    err = [np.linalg.norm(Q.dequantize_int4(qw) - w) for qw in (absmax, mse)]
    assert err[1] < 0.9 * err[0]
    assert (mse.scales.astype(np.float32) < 0).any()  # signed /-8 candidates were chosen
    with pytest.raises(ValueError, match="unknown int4 scale method"):
        Q.quantize_int4_rtn(w, scale_method="minmax")


def test_int4_zero_group_gives_zero_scale_and_values():
    w = _weights(4, 256, 6, 1.0)
    w[128:, 2] = 0.0
    qw = Q.quantize_int4_rtn(w)
    assert qw.scales[1, 2] == 0
    deq = Q.dequantize_int4(qw)
    assert np.all(deq[128:, 2] == 0) and np.all(np.isfinite(deq))


def test_int4_rtn_equals_the_formula_element_by_element():
    """Against the module docstring's formula written out per element (scales from a float64
    absmax, expanded to every element): ties round to even, zero groups give zeros."""
    rng = np.random.default_rng(5)
    w = rng.standard_t(4, size=(2, 384, 40)).astype(np.float32)
    w[0, :128, 3] = 0.0  # a zero group
    ties = rng.integers(-7, 7, (128, 40)) + 0.5  # a group of absmax 7: scale 1, exact halves
    ties[0] = 7.0
    w[1, 128:256] = ties
    absmax = np.abs(w.astype(np.float64)).reshape(2, 3, 128, 40).max(axis=2)
    scales = (absmax / 7).astype(np.float32).astype(BF16)
    s = np.repeat(scales.astype(np.float32), 128, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        expect = np.where(s == 0, 0, np.clip(np.rint(w / s), -8, 7)).astype(np.int8)
    qw = Q.quantize_int4_rtn(w)
    np.testing.assert_array_equal(qw.scales, scales)
    np.testing.assert_array_equal(Q.unpack_int4(qw.packed), expect)
    assert (expect[1, 128:256] % 2 == 0)[ties % 1 == 0.5].all()  # every tie went to even


def test_int4_leading_axes_match_per_slice():
    w = np.stack([_weights(s, 256, 24, 0.05) for s in range(3)])
    qw = Q.quantize_int4_rtn(w)
    assert qw.packed.shape == (3, 24, 128) and qw.scales.shape == (3, 2, 24)
    for e in range(3):
        one = Q.quantize_int4_rtn(w[e])
        np.testing.assert_array_equal(qw.packed[e], one.packed)
        np.testing.assert_array_equal(qw.scales[e], one.scales)
    deq = np.asarray(Q.dequantize_int4_jnp(jnp.asarray(qw.packed), jnp.asarray(qw.scales)))
    np.testing.assert_array_equal(deq, Q.dequantize_int4(qw))


# --------------------------------------------------------------------------- int8


@SETTINGS
@given(shape=shapes, seed=seeds, scale=magnitudes)
def test_int8_round_trip_within_half_step(shape, seed, scale):
    w = _weights(seed, *shape, scale)
    qw = Q.quantize_int8(w)
    assert qw.q.dtype == np.int8 and qw.scales.dtype == BF16 and qw.scales.shape == (shape[1],)
    assert np.abs(qw.q.astype(int)).max() <= 127
    s = qw.scales.astype(np.float32)
    deq = Q.dequantize_int8(qw)
    assert np.all(np.abs(deq - w) <= s * (0.5 + 1e-6))


_dequant_int8 = jax.jit(Q.dequantize_int8_jnp, static_argnums=2)


@SETTINGS
@given(shape=jnp_shapes, seed=seeds, scale=magnitudes)
def test_int8_jnp_dequant_matches_numpy_exactly(shape, seed, scale):
    qw = Q.quantize_int8(_weights(seed, *shape, scale))
    deq = Q.dequantize_int8(qw)
    q, scales = jnp.asarray(qw.q), jnp.asarray(qw.scales)
    np.testing.assert_array_equal(np.asarray(_dequant_int8(q, scales, jnp.float32)), deq)
    bf16 = np.asarray(_dequant_int8(q, scales, jnp.bfloat16))
    np.testing.assert_array_equal(bf16, deq.astype(BF16))


def test_int8_scale_after_matmul():
    rng = np.random.default_rng(5)
    w = rng.normal(size=(96, 40)).astype(np.float32)
    x = rng.normal(size=(7, 96)).astype(np.float32)
    qw = Q.quantize_int8(w)
    ref = x.astype(np.float64) @ Q.dequantize_int8(qw).astype(np.float64)
    got = np.asarray(Q.int8_matmul_jnp(jnp.asarray(x), jnp.asarray(qw.q), jnp.asarray(qw.scales)))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


# --------------------------------------------------------------------------- bytes


def test_byte_accounting():
    k, n = 4096, 14336
    assert Q.int4_bytes(k, n) == k * n // 2 + (k // 128) * n * 2
    assert Q.int8_bytes(k, n) == k * n + 2 * n
    assert Q.dense_bytes(k, n, "bfloat16") == Q.dense_bytes(k, n, jnp.bfloat16) == 2 * k * n
    assert Q.dense_bytes(k, n, np.float32) == 4 * k * n
    qw = Q.quantize_int4_rtn(_weights(1, 256, 16, 1.0))
    assert qw.packed.nbytes + qw.scales.nbytes == Q.int4_bytes(256, 16)
