"""The int4 kernel's input order (CPU): what `permute_k` must be for the register view to work.

The Mosaic kernel itself runs on Hopper only (tests/test_expert_kernels.py, against float64)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from strata_jax.int4_kernel import BIAS, permute_k


def _view_columns() -> np.ndarray:
    """For each physical input p of a 32-block, the logical input the kernel multiplies it by:
    lane c (of 4 per row) loads physical 8c .. 8c+7 as one word (UPCAST_4X), the conversion
    pairs nibbles a and a + 4, and wgmma reads pair a as logical 8a + 2c + {0, 1} (WGMMA)."""
    logical = np.empty(32, np.int64)
    for c in range(4):
        for e in range(8):  # nibble e of lane c's word: pair a = e % 4, half b = e // 4
            logical[8 * c + e] = 8 * (e % 4) + 2 * c + e // 4
    return logical


def _convert_pair(word: int, a: int) -> tuple[float, float]:
    """The kernel's conversion of pair a of a 32-bit word, bit for bit: (word >> 4a) & 0x000F000F
    ^ 0x43084308, read as two bf16 (low half first)."""
    bits = ((word >> (4 * a)) & 0x000F000F) ^ 0x43084308
    halves = np.array([bits & 0xFFFF, bits >> 16], np.uint16)
    return tuple(halves.view(ml_dtypes.bfloat16).astype(np.float32))


def test_conversion_gives_q_plus_bias_for_every_nibble():
    rng = np.random.default_rng(1)
    for word in [0, 0xFFFFFFFF, 0x76543210, 0x89ABCDEF, *rng.integers(0, 2**32, 20)]:
        q = [((int(word) >> (4 * e)) & 0xF) - 16 * (((int(word) >> (4 * e)) & 0xF) >= 8)
             for e in range(8)]  # the word's 8 signed nibbles, element e at bits 4e
        for a in range(4):
            assert _convert_pair(int(word), a) == (q[a] + BIAS, q[a + 4] + BIAS)


def test_permute_k_feeds_each_weight_its_own_input():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 128)).astype(np.float32)
    w = rng.normal(size=(5, 128)).astype(np.float32)
    logical = np.concatenate([_view_columns() + 32 * b for b in range(4)])
    w_view = np.empty_like(w)
    w_view[:, logical] = w  # the weights as the kernel's wgmma sees them
    x_in = np.asarray(permute_k(jnp.asarray(x)))
    np.testing.assert_array_equal(x_in[:, logical], x)
    np.testing.assert_allclose(x_in @ w_view.T, x @ w.T, rtol=0, atol=1e-4)


def test_permute_k_permutes_within_32_blocks():
    x = jnp.arange(2 * 96, dtype=jnp.float32).reshape(2, 96)
    y = np.asarray(permute_k(x))
    assert not np.array_equal(y, x)
    blocks = y.reshape(2, 3, 32)
    np.testing.assert_array_equal(np.sort(blocks, axis=-1), np.asarray(x).reshape(2, 3, 32))
