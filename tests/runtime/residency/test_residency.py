"""The page tables a step reads are a snapshot: later moves between steps do not reach it."""

import jax
import numpy as np

from strata_runtime.residency.tiers import Residency


def _aligned(shape: tuple[int, ...]) -> np.ndarray:
    """-1s in a 64-byte aligned buffer: what the CPU backend takes without a copy."""
    n = int(np.prod(shape))
    raw = np.empty(n + 16, np.int32)
    first = (-raw.ctypes.data // 4) % 16
    out = raw[first : first + n].reshape(shape)
    out[:] = -1
    return out


def test_tiers_do_not_alias_the_tables_that_change_in_place():
    rng = np.random.default_rng(0)
    experts = {(layer, e): {n: rng.standard_normal((4, 8)).astype(np.float32)
                            for n in ("w1", "w3", "w2")}
               for layer in range(2) for e in range(4)}
    res = Residency(2, 4, jax.devices()[0], experts.__getitem__, [(0, 0), (1, 2)], 3, 1,
                    list(experts), 8)
    aligned = _aligned(res.page.shape)
    aligned[:] = res.page
    res.page = aligned
    tiers = res.tiers()
    before = np.asarray(tiers.page).copy()
    res.promote((0, 3), 2)
    res.demote(0)
    assert res.slot_of((0, 3)) == 2 and res.slot_of((0, 0)) is None
    np.testing.assert_array_equal(np.asarray(tiers.page), before)
    np.testing.assert_array_equal(np.asarray(res.tiers().page), res.page)
