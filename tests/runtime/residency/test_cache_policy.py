"""Eviction order of each policy, the heat estimate, and rebalancing with hysteresis."""

import numpy as np
import pytest

from strata_runtime.residency.cache_policy import ExpertCache, HeatEstimate, check_policy, rebalance


def _cache(policy):
    c = ExpertCache(policy, 3)
    for key in [(0, 0), (0, 1), (0, 2)]:
        c.add(key)
    return c


def test_lru_evicts_least_recent():
    c = _cache("lru")
    c.touch((0, 0))
    assert c.victim() == (0, 1)


def test_lfu_evicts_least_used():
    c = _cache("lfu")
    c.touch((0, 0))
    c.touch((0, 0))
    c.touch((0, 1))
    assert c.victim() == (0, 2)


def test_lfru_evicts_the_least_used_of_the_older_half():
    c2 = ExpertCache("lfru", 4)
    for key in [(1, 0), (1, 1), (1, 2), (1, 3)]:
        c2.add(key)
    for _ in range(3):
        c2.touch((1, 0))
    c2.touch((1, 2))
    c2.touch((1, 3))
    # older half by recency: (1, 1) and (1, 0); (1, 1) is used less
    assert c2.victim() == (1, 1)


def test_offer_fills_free_slots_then_admits_by_the_rule():
    heat = np.zeros((2, 4))
    heat[0] = [5.0, 1.0, 3.0, 0.5]
    for rule, admitted in (("always", [True, True]), ("hotter", [False, True])):
        c = ExpertCache("lru", 2, rule)
        assert c.offer((0, 1), heat) == (True, None) and c.offer((0, 2), heat) == (True, None)
        # full: the victim is the least recent, (0, 1) with heat 1.0
        got = c.offer((0, 3), heat)  # heat 0.5: colder than the victim
        assert got == ((True, (0, 1)) if admitted[0] else (False, None))
        assert ((0, 3) in c) == admitted[0] and len(c) == 2
        victim = c.victim()
        assert c.offer((0, 0), heat) == (admitted[1], victim)  # heat 5.0: hotter
        assert (0, 0) in c and victim not in c


def test_current_heat_folds_in_the_step_so_far():
    h = HeatEstimate(1, 3, decay=0.5)
    h.observe(0, np.array([2.0, 0.0, 0.0]))
    h.end_step()
    h.observe(0, np.array([0.0, 4.0, 0.0]))
    np.testing.assert_allclose(h.current(), [[0.5, 2.0, 0.0]])
    h.end_step()
    np.testing.assert_allclose(h.heat, [[0.5, 2.0, 0.0]])


def test_static_has_no_capacity_and_bad_names_fail():
    assert ExpertCache("static", 5).capacity == 0
    with pytest.raises(ValueError, match="policy must be one of"):
        check_policy("fifo")
    with pytest.raises(ValueError, match="cache admission must be one of"):
        ExpertCache("lru", 2, "never")


def test_heat_is_an_ema_of_counts():
    h = HeatEstimate(1, 4, decay=0.5)
    h.observe(0, np.array([2, 1, 1, 0]))  # tokens routed to each expert
    h.end_step()
    np.testing.assert_allclose(h.heat[0], [1.0, 0.5, 0.5, 0.0])
    h.end_step()
    np.testing.assert_allclose(h.heat[0], [0.5, 0.25, 0.25, 0.0])


def test_rebalance_swaps_only_past_hysteresis():
    heat = np.array([[1.0, 5.0, 1.05, 0.2]])
    swaps = rebalance(heat, {(0, 0), (0, 3)}, hysteresis=0.1)
    assert swaps == [((0, 3), (0, 1))]  # (0, 2) is not 10 % hotter than (0, 0)
    assert rebalance(heat, {(0, 1), (0, 2)}, hysteresis=0.1) == []


def test_the_simulator_replays_the_engines_admissions(tmp_path, policy="lfru"):
    """One admission logic (`cache_policy.admit`): an offloaded run's routing trace replayed
    by the simulator, with the engine's pinned set and cache slots, admits as many experts as
    the engine did."""
    from strata_runtime.engine.config import EngineConfig
    from strata_runtime.engine.offload import Engine
    from strata_runtime.engine.trace import load_trace
    from strata_runtime.lab.simulate import simulate
    from tests.helpers import tiny_config, write_checkpoint

    write_checkpoint(tiny_config("qwen3_moe", num_experts=8), tmp_path / "ck", seed=4)
    config = EngineConfig(hbm_budget=None, resident_experts=6, policy=policy,
                          cache_fraction=0.5, cache_admit="always", batch_capacity=2,
                          max_len=64, record_trace=str(tmp_path / "t.npz"))
    with Engine.from_checkpoint(tmp_path / "ck", config) as engine:
        share = engine.shares[0]
        pinned = sorted(share.pinned)
        engine.generate([[5, 9, 2, 7], [8, 8, 4, 1, 6]], 8)
        admitted = engine.stats()["by_phase"]
    took = sum(phase["totals"]["admissions"] for phase in admitted.values())
    assert took > 0
    replay = simulate(load_trace(tmp_path / "t.npz"), policy, pinned=pinned,
                      cache=share.cache.capacity, staging=1, cache_admit="always")
    assert replay.admissions == took
