"""The int4 kernel's input order (CPU): what `permute_k` must be for the register view to work.

The Mosaic kernel itself runs on Hopper only (tests/test_expert_kernels.py, against float64)."""

import jax.numpy as jnp
import numpy as np

from strata_jax.int4_kernel import permute_k


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
