"""Host dequantization equals the float64 definition of the packed int4 format."""

import jax
import ml_dtypes
import numpy as np
import pytest

from strata_runtime.host_dequant import HostDequantizer


def _packed(seed, k=512, n=48):
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, (k, n))
    scales = rng.uniform(0.001, 0.05, (k // 128, n)).astype(ml_dtypes.bfloat16)
    nib = q.T & 0xF  # output-major, K pairs in a byte, two's-complement nibbles
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    ref = q * np.repeat(scales.astype(np.float64), 128, axis=0)
    return packed, scales, ref


@pytest.mark.parametrize("threads", [1, 3])
def test_matches_reference_rounded_to_bf16(threads):
    packed, scales, ref = _packed(threads)
    dq = HostDequantizer(threads=threads)
    out = dq.dequantize(packed, scales)
    assert out.dtype == ml_dtypes.bfloat16
    # output-major [N, K]: the packed bytes' order (the slots transpose it on the device)
    np.testing.assert_array_equal(out, ref.T.astype(np.float32).astype(ml_dtypes.bfloat16))
    many = dq.dequantize_many([(packed, scales)] * 3)
    assert all(np.array_equal(m, out) for m in many)
    dq.close()


def test_cache_is_bounded_and_counts_hits():
    packed, scales, _ = _packed(5, k=256, n=32)
    one = 256 * 32 * 2
    dq = HostDequantizer(threads=2, cache_bytes=2 * one)
    for key in ["a", "b", "a", "c", "b"]:
        dq.get(key, packed, scales)
    assert (dq.hits, dq.misses) == (1, 4)  # "b" was evicted by "c" (LRU: a, c remain)
    dq.close()


def test_mismatched_scales_are_rejected():
    packed, scales, _ = _packed(6)
    with pytest.raises(ValueError, match="scales shape"):
        HostDequantizer(threads=1).dequantize(packed, scales[:1])


def test_pinned_results_are_pinned_host_arrays_with_the_same_values():
    packed, scales, _ = _packed(7, k=256, n=32)
    device = jax.devices()[0]
    dq = HostDequantizer(threads=1, cache_bytes=1 << 20, pin=device)
    out = dq.get("w1", packed, scales)
    assert isinstance(out, jax.Array) and out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out), HostDequantizer(threads=1).dequantize(
        packed, scales))
    assert dq.get("w1", packed, scales) is out and dq.hits == 1  # the cached pinned array
    dq.close()
