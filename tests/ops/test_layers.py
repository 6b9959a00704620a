"""layers: the ordered short sums, against numpy float32 adds in index order (the order the
resident and offloaded programs must both add in: docs/design.md, "Disk stalls")."""

import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.ops.layers import ordered_sum


def _in_order(a: np.ndarray, axis: int) -> np.ndarray:
    parts = np.moveaxis(a, axis, 0)
    total = parts[0].copy()
    for part in parts[1:]:
        total = (total + part).astype(np.float32)
    return total


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_ordered_sum_adds_in_index_order(axis):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((4, 5, 6)) * 10.0 ** rng.integers(-4, 5, (4, 5, 6)))
    a = a.astype(np.float32)
    want = _in_order(a, axis)
    got = np.asarray(ordered_sum(jnp.asarray(a), axis))
    np.testing.assert_array_equal(got, want)
    kept = np.asarray(ordered_sum(jnp.asarray(a), axis, keepdims=True))
    np.testing.assert_array_equal(kept, np.expand_dims(want, axis))


def test_the_order_is_not_the_pairwise_one():
    """Values whose sum rounds differently paired up and in order: the ordered sum is the
    in-order one, so a change to a tree reduce would show here."""
    a = np.array([1.0, 2.0**-24, 2.0**-24, 2.0**-24], np.float32)
    in_order = np.float32(np.float32(np.float32(a[0] + a[1]) + a[2]) + a[3])
    pairwise = np.float32(np.float32(a[0] + a[1]) + np.float32(a[2] + a[3]))
    assert in_order != pairwise
    assert np.asarray(ordered_sum(jnp.asarray(a), 0)) == in_order
