"""SlotPool: in-place installs, page table, and exactness against a resident pool."""

import jax
import numpy as np
import pytest

from strata_jax import api
from strata_jax.checkpoint import expert_arrays
from strata_jax.moe import apply_experts, route
from strata_runtime.slot_pool import SlotPool
from tests.helpers import random_arrays, tiny_config


def _pool_for(cfg, permanent=5, staging=2):
    return SlotPool(expert_arrays(cfg), cfg.num_layers, cfg.num_experts, permanent, staging)


def test_admit_evict_and_page_table():
    cfg = tiny_config()
    _, _, experts = random_arrays(cfg)
    pool = _pool_for(cfg)
    one = {k: v[1, 3] for k, v in experts.items()}
    slot = pool.admit(1, 3, one)
    assert pool.slot_of(1, 3) == slot and pool.resident() == {(1, 3): slot}
    np.testing.assert_array_equal(np.asarray(pool.arrays.w2[slot]), experts["w2"][1, 3])
    with pytest.raises(ValueError, match="already resident"):
        pool.admit(1, 3, one)
    assert pool.evict(1, 3) == slot and pool.slot_of(1, 3) is None
    with pytest.raises(KeyError, match="layer 1 expert 3"):
        pool.evict(1, 3)


def test_transposed_arrays_are_installed_in_slot_order():
    cfg = tiny_config()
    _, _, experts = random_arrays(cfg)
    pool = SlotPool(expert_arrays(cfg), cfg.num_layers, cfg.num_experts, 3, 1,
                    transposed=("w1", "w2"))
    one = {k: v[0, 2] for k, v in experts.items()}
    sent = {k: (np.swapaxes(v, -1, -2) if k in ("w1", "w2") else v) for k, v in one.items()}
    slot = pool.admit(0, 2, sent)
    for k in ("w1", "w3", "w2"):  # w3 arrives as the slot holds it
        np.testing.assert_array_equal(np.asarray(getattr(pool.arrays, k)[slot]), one[k])


def test_full_pool_refuses_admission():
    cfg = tiny_config()
    _, _, experts = random_arrays(cfg)
    pool = _pool_for(cfg, permanent=2)
    for e in range(2):
        pool.admit(0, e, {k: v[0, e] for k, v in experts.items()})
    with pytest.raises(RuntimeError, match="no free permanent slot"):
        pool.admit(0, 2, {k: v[0, 2] for k, v in experts.items()})


def test_installs_do_not_grow_device_memory():
    cfg = tiny_config()
    _, _, experts = random_arrays(cfg)
    pool = _pool_for(cfg)
    before = pool.nbytes
    for i in range(20):
        pool.install(pool.staging_slots()[0], {k: v[0, i % 6] for k, v in experts.items()})
    assert pool.nbytes == before
    live = sum(a.nbytes for a in jax.live_arrays())
    for i in range(20):
        pool.install(pool.staging_slots()[1], {k: v[1, i % 6] for k, v in experts.items()})
    assert sum(a.nbytes for a in jax.live_arrays()) <= live


def test_mixed_permanent_and_staged_slots_match_resident_bit_for_bit():
    cfg = tiny_config()
    g, layers, experts = random_arrays(cfg, seed=3)
    resident = api.from_arrays(cfg, g, layers, experts)
    pool = _pool_for(cfg, permanent=3, staging=4)
    layer = 1
    row = np.zeros(cfg.num_experts, np.int32)
    for e in range(cfg.num_experts):  # experts 0-2 permanent, 3-5 staged
        arrays = {k: v[layer, e] for k, v in experts.items()}
        if e < 3:
            row[e] = pool.admit(layer, e, arrays)
        else:
            row[e] = pool.staging_slots()[e - 3]
            pool.install(int(row[e]), arrays)
    x = np.random.default_rng(0).normal(size=(5, cfg.hidden_size)).astype(np.float32)
    lp = resident.params["layers"][layer]
    routing = route(x, lp["router"], cfg.top_k, cfg.norm_topk_prob)
    ref = apply_experts(x, routing, resident.experts, resident.slot_table[layer])
    got = apply_experts(x, routing, pool.arrays, row)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
