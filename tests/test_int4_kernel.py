"""The int4 kernel's input order (CPU): what `permute_k` must be for the register view to work.

The Mosaic kernel itself runs on Hopper only (tests/test_expert_kernels.py, against float64)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from strata_jax.int4_kernel import BIAS, permute_k


def _view_columns() -> np.ndarray:
    """For each physical input p of a 32-block, the logical input the kernel multiplies it by:
    lane c (of 4 per row) loads physical 8c .. 8c+7 as one word (UPCAST_4X) and wgmma reads its
    pair a as logical 8a + 2c + {0, 1} (WGMMA layout)."""
    logical = np.empty(32, np.int64)
    for c in range(4):
        for e in range(8):  # element e of lane c's word: pair a = e // 2, half b = e % 2
            logical[8 * c + e] = 8 * (e // 2) + 2 * c + e % 2
    return logical


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


def test_permute_k_is_an_involution_within_32_blocks():
    x = jnp.arange(2 * 96, dtype=jnp.float32).reshape(2, 96)
    y = permute_k(x)
    np.testing.assert_array_equal(permute_k(y), x)
    assert not np.array_equal(y, x)
    blocks = np.asarray(y).reshape(2, 3, 32)
    np.testing.assert_array_equal(np.sort(blocks, axis=-1), np.asarray(x).reshape(2, 3, 32))


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 (default mode): result byte i is byte (selector nibble i & 7) of {b, a},
    or with bit 3 of the nibble set, that byte's sign bit replicated."""
    source = (b << 32 | a).to_bytes(8, "little")
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = source[nibble & 7]
        out |= ((0xFF if byte & 0x80 else 0) if nibble & 8 else byte) << (8 * i)
    return out


def test_biased_conversion_gives_q_plus_bias_for_every_pair():
    """`Int4Tiles(biased=True)`'s prmt + lop3, bit for bit: pair a of a word is its nibbles
    2a and 2a + 1 as bf16 q + BIAS (the kernel takes BIAS * sum(x) out of the product)."""
    rng = np.random.default_rng(1)
    for word in [0, 0xFFFFFFFF, 0x76543210, 0x89ABCDEF, *map(int, rng.integers(0, 2**32, 20))]:
        nibbles = [(word >> (4 * e)) & 0xF for e in range(8)]
        q = [n - 16 if n >= 8 else n for n in nibbles]  # two's complement int4
        for a in range(4):
            t = _prmt(word, word >> 4, 0xF0F0 | (a + 4) << 8 | a)
            bits = (t & 0x000F000F) ^ 0x43084308  # lop3 immLut 0x6a: (t & b) ^ c
            halves = np.array([bits & 0xFFFF, bits >> 16], np.uint16).view(ml_dtypes.bfloat16)
            assert list(halves.astype(np.float64)) == [q[2 * a] + BIAS, q[2 * a + 1] + BIAS]
