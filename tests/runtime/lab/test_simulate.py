"""The trace simulator: its replay of the engine's cache equals independent references (a tiny
LRU, Mattson's stack distances), Belady equals an exhaustive search and bounds every policy,
the prefetch oracle, pinning as the engine places, and the cost model's formula by hand."""

import functools
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_runtime.engine.shares import placement
from strata_runtime.engine.trace import RoutingTrace, reuse_distances, synthetic_trace
from strata_runtime.lab.cost_model import (
    PROFILES,
    HardwareProfile,
    ModelCost,
    model_cost,
    predict,
    profile,
)
from strata_runtime.lab.simulate import (
    belady,
    compare,
    hosted_misses,
    pinned_by_heat,
    predict_replay,
    prefetch_hidden,
    simulate,
    step_keys,
)
from strata_runtime.residency.cache_policy import ADMITS, POLICIES
from tests.helpers import tiny_config


def hand_trace(steps, num_experts, prefill=None) -> RoutingTrace:
    """steps[s][layer]: the experts routed at that layer (non-empty); top-1 rows cycle
    through each layer's list, so the distinct experts per layer are exactly those."""
    num_layers = len(steps[0])
    rows = []
    for layers in steps:
        n = max(len(x) for x in layers)
        rows.append([[[layers[lay][r % len(layers[lay])]] for lay in range(num_layers)]
                     for r in range(n)])
    sizes = [len(r) for r in rows]
    return RoutingTrace(
        num_layers=num_layers, num_experts=num_experts, top_k=1, seed=None, extra={},
        experts=np.array([row for step in rows for row in step], np.int16).reshape(-1,
                                                                                   num_layers, 1),
        rows=np.concatenate([np.arange(n) for n in sizes]).astype(np.int32),
        requests=np.concatenate([np.arange(n) for n in sizes]).astype(np.int64),
        offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        widths=np.array(sizes, np.int32),
        prefill=np.zeros(len(steps), bool) if prefill is None else np.array(prefill))


@st.composite
def tiny_traces(draw):
    num_layers, num_experts = draw(st.integers(1, 2)), draw(st.integers(2, 5))
    subset = st.lists(st.integers(0, num_experts - 1), min_size=1, max_size=num_experts,
                      unique=True)
    steps = draw(st.lists(st.lists(subset, min_size=num_layers, max_size=num_layers),
                          min_size=1, max_size=6))
    return hand_trace(steps, num_experts)


SYNTHETIC = {
    "skewed": synthetic_trace(3, 8, 2, 60, 3, 1.2, seed=7),
    "drifting": synthetic_trace(3, 8, 2, 60, 3, 1.0, seed=7, drift_at=30),
    "uniform": synthetic_trace(3, 8, 2, 60, 3, 0.0, seed=7),
}


# --- the replay against independent references ----------------------------------------------


def tiny_lru(keys, pinned, capacity, admission):
    """LRU written plainly: a list, most recent last; "engine" admits a step after the next."""
    cache, hits, pending = [], 0, []

    def admit(step):
        for k in step:
            if k in pinned or capacity == 0:
                continue
            if k in cache:
                cache.remove(k)
            elif len(cache) == capacity:
                cache.pop(0)
            cache.append(k)

    for step in keys:
        for k in step:
            hits += k in pinned or k in cache
            if admission == "demand":
                admit([k])
        if admission == "engine":
            admit(pending)
            pending = step
    return hits


@pytest.mark.parametrize("admission", ["engine", "demand"])
@pytest.mark.parametrize("name", list(SYNTHETIC))
def test_lru_replay_equals_a_plain_lru(name, admission):
    t = SYNTHETIC[name]
    keys = step_keys(t)
    for pinned_n, capacity in itertools.product([0, 5], [0, 1, 4, 9, 30]):
        pinned = pinned_by_heat(t, pinned_n)
        r = simulate(t, "lru", pinned=pinned, cache=capacity, staging=2, admission=admission,
                     cache_admit="always")
        assert r.hits == tiny_lru(keys, set(pinned), capacity, admission)
        assert r.misses == r.layer_misses.sum()


def test_demand_lru_hits_are_the_reuse_distances_below_capacity():
    t = SYNTHETIC["skewed"]
    flat = np.array([k * t.num_experts + e for step in step_keys(t) for k, e in step])
    distances = reuse_distances(flat)
    for capacity in (1, 6, 15, 40):
        r = simulate(t, "lru", pinned=[], cache=capacity, staging=1, admission="demand",
                     cache_admit="always")
        assert r.hits == ((distances >= 0) & (distances < capacity)).sum()


def test_engine_admission_lags_one_step_and_prefill_admits_at_once():
    a, b = 0, 1
    steps = [[[a]], [[b]], [[a, b]]]
    lagged = simulate(hand_trace(steps, 2), "lru", pinned=[], cache=2, staging=1,
                      cache_admit="always")
    assert lagged.hits == 1  # step 2 sees a (step 0) but not yet b (step 1)
    prefilled = simulate(hand_trace(steps, 2, prefill=[False, True, False]), "lru",
                         pinned=[], cache=2, staging=1, cache_admit="always")
    assert prefilled.hits == 2  # prefill flushes step 0's record, then admits its own


def test_admitting_only_hotter_experts_halves_the_copies_of_a_large_batch():
    """At 16 rows a step routes to more experts than the cache holds: admitting each one
    copies it a second time and evicts what the next steps route to again."""
    t = synthetic_trace(6, 64, 4, 40, 16, 1.0, seed=0)
    pinned = pinned_by_heat(t, 100)
    always, hotter = (simulate(t, "lfru", pinned=pinned, cache=35, staging=16, cache_admit=a)
                      for a in ADMITS)
    assert hotter.copies < 0.6 * always.copies
    assert hotter.admissions < always.admissions and hotter.misses <= always.misses


def test_static_uses_only_the_pinned_slots():
    t = SYNTHETIC["skewed"]
    pinned = pinned_by_heat(t, 6)
    r = simulate(t, "static", pinned=pinned, cache=10, staging=2)
    assert r.hits == r.pinned_hits > 0 and r.admissions == 0


def test_pinned_by_heat_is_the_engines_placement():
    t = SYNTHETIC["drifting"]
    cfg = tiny_config(num_layers=t.num_layers, num_experts=t.num_experts, top_k=t.top_k)
    for n in (0, 3, 11):
        assert pinned_by_heat(t, n) == placement(cfg, n, 0, t.counts())[0]


def test_bad_knobs_are_refused():
    with pytest.raises(ValueError, match="policy must be one of"):
        simulate(SYNTHETIC["skewed"], "fifo", pinned=[], cache=1, staging=1)
    with pytest.raises(ValueError, match="admission must be one of"):
        simulate(SYNTHETIC["skewed"], "lru", pinned=[], cache=1, staging=1, admission="late")


# --- Belady ------------------------------------------------------------------------------------


def brute_force_hits(trace, pinned, capacity):
    """The most hits over every choice at every miss: keep the key (evicting any cached
    one, or into a free slot) or bypass it."""
    flat = [k for step in step_keys(trace) for k in step]

    @functools.cache
    def best(i, held):
        if i == len(flat):
            return 0
        key = flat[i]
        if key in pinned or key in held:
            return 1 + best(i + 1, held)
        options = [held]
        if capacity:
            options += ([held | {key}] if len(held) < capacity
                        else [(held - {v}) | {key} for v in held])
        return max(best(i + 1, h) for h in options)

    return best(0, frozenset())


@settings(max_examples=40, deadline=None)
@given(trace=tiny_traces(), capacity=st.integers(0, 3), pinned_n=st.integers(0, 2))
def test_belady_equals_an_exhaustive_search(trace, capacity, pinned_n):
    pinned = pinned_by_heat(trace, pinned_n)
    opt = belady(trace, pinned=pinned, cache=capacity, staging=1)
    assert opt.hits == brute_force_hits(trace, frozenset(pinned), capacity)


@settings(max_examples=30, deadline=None)
@given(trace=tiny_traces(), capacity=st.integers(0, 4), pinned_n=st.integers(0, 2))
def test_belady_bounds_every_policy_on_tiny_traces(trace, capacity, pinned_n):
    """Demand admission: Belady hits at least as often. Engine admission: Belady's misses
    are at most the policy's copies (misses + admissions)."""
    pinned = pinned_by_heat(trace, pinned_n)
    for admission, rule in itertools.product(("demand", "engine"), ADMITS):
        results, opt = compare(trace, pinned=pinned, cache=capacity, staging=1,
                               admission=admission, cache_admit=rule)
        for r in results:
            assert opt.misses <= r.copies
            if admission == "demand":
                assert opt.hits >= r.hits, r.name


@pytest.mark.parametrize("name", list(SYNTHETIC))
def test_belady_hits_at_least_every_policy_on_synthetic_traces(name):
    t = SYNTHETIC[name]
    for pinned_n, capacity in itertools.product([0, 4], [0, 1, 3, 6, 12, 40]):
        pinned = pinned_by_heat(t, pinned_n)
        for admission, rule in itertools.product(("engine", "demand"), ADMITS):
            results, opt = compare(t, POLICIES, pinned=pinned, cache=capacity, staging=2,
                                   admission=admission, cache_admit=rule)
            assert [r.name for r in results] == list(POLICIES)
            for r in results:
                assert opt.hits >= r.hits and opt.misses <= r.copies, (r.name, admission)
            assert opt.pinned_hits == results[0].pinned_hits


def test_a_lagged_policy_can_out_hit_belady_only_by_copying_again():
    """Capacity 1, steps a, b, a, b: the engine's LRU re-admits each expert a step late and
    hits twice (the last step's admission too, when the engine observes it); Belady (no late
    copies) hits once, with fewer copies."""
    t = hand_trace([[[0]], [[1]], [[0]], [[1]]], 2)
    lru = simulate(t, "lru", pinned=[], cache=1, staging=1, cache_admit="always")
    opt = belady(t, pinned=[], cache=1, staging=1)
    assert (lru.hits, lru.admissions, lru.copies) == (2, 4, 6)
    assert (opt.hits, opt.copies) == (1, 3)


def test_prefetch_oracle_hides_up_to_staging_per_layer_but_the_first():
    misses = np.array([[3, 1, 0], [5, 2, 4]])
    assert prefetch_hidden(misses, 2) == 0 + 1 + 0 + 2 + 2 + 2
    r = simulate(SYNTHETIC["uniform"], "lru", pinned=[], cache=3, staging=1)
    assert r.hidden == prefetch_hidden(r.layer_misses, 1)
    assert 0 < r.prefetch_bound < 1


# --- the cost model ----------------------------------------------------------------------------


ROUND = HardwareProfile(name="round", pcie_gbps=50.0, host_read_gbps=100.0, hbm_gbps=5000.0,
                        hbm_gib=80.0, matmul_tflops=500.0, host_cores=8)
MODEL = ModelCost(bytes_per_expert=100_000_000, dense_bytes=2_000_000_000,
                  flops_per_token=1e10)


def test_the_cost_formula_by_hand():
    p = predict(ROUND, MODEL, batch=8, routed=40, misses=10, admissions=2, hidden=0.5)
    # t_hbm = (2e9 + 40 x 1e8) / 5e12 = 1.2 ms; t_compute = 8 x 1e10 / 5e14 = 0.16 ms;
    # t_copy = 10 x 1e8 / 5e10 = 20 ms; t_admit = 2 x 1e8 / 5e10 = 4 ms
    # the 10 ms of demand copies share the link with the 10 ms prefetched for the next layer:
    # they land after 20 ms, then the layer reads (1.2 ms); step = 21.2 + 4 = 25.2 ms
    assert p.terms == pytest.approx({"t_hbm": 1.2e-3, "t_compute": 1.6e-4, "t_copy": 0.02,
                                     "t_host": 0.0, "t_unused": 0.0, "t_admit": 0.004,
                                     "t_disk": 0.0, "t_engine": 0.0})
    assert p.step_s == pytest.approx(0.0252) and p.tok_s == pytest.approx(8 / 0.0252)
    # an engine whose host work takes 30 ms a step paces the loop; at 10 ms it hides
    slow_engine = predict(ROUND, MODEL, batch=8, routed=40, misses=10, admissions=2,
                          hidden=0.5, engine_s=0.03)
    assert slow_engine.step_s == pytest.approx(0.03) and slow_engine.binding == "engine"
    assert predict(ROUND, MODEL, batch=8, routed=40, misses=10, admissions=2, hidden=0.5,
                   engine_s=0.01).step_s == pytest.approx(0.0252)
    # a quarter prefetched: 15 ms of demand copies land after 20 ms, the layer reads (1.2 ms)
    # beside nothing left of the prefetches
    assert predict(ROUND, MODEL, batch=8, routed=40, misses=10, hidden=0.25).step_s == (
        pytest.approx(0.0212))
    # a few prefetches, none needed on demand: they run behind the reads (the longer counts)
    assert predict(ROUND, MODEL, batch=8, routed=40, misses=0.5, hidden=1.0, unused=0.2
                   ).step_s == pytest.approx(1.4e-3)
    assert p.binding == "pcie"
    compute = predict(ROUND, MODEL, batch=1000, routed=40, misses=0)
    assert compute.binding == "compute" and compute.tok_s == pytest.approx(1000 / 0.02)
    hbm = predict(ROUND, MODEL, batch=1, routed=40, misses=0.5, hidden=1.0)  # t_copy 1 ms
    assert hbm.binding == "hbm" and hbm.step_s == pytest.approx(1.2e-3)
    # an expert kernel reading at 1,000 GB/s: 40 x 1e8 / 1e12 = 4 ms beside the dense 0.4 ms
    slow_kernel = HardwareProfile(**{**ROUND.__dict__, "expert_read_gbps": 1000.0})
    assert predict(slow_kernel, MODEL, batch=1, routed=40, misses=0).terms["t_hbm"] == (
        pytest.approx(4.4e-3))
    # the step without experts at 1,000 GB/s: its 2e9 dense bytes take 2 ms; the KV cache
    # passed apart (5e8 bytes) stays at the plain read, 0.1 ms; the experts 0.8 ms
    slow_dense = HardwareProfile(**{**ROUND.__dict__, "dense_read_gbps": 1000.0})
    assert predict(slow_dense, MODEL, batch=1, routed=40, misses=0, extra_hbm_bytes=5e8
                   ).terms["t_hbm"] == pytest.approx(2e-3 + 1e-4 + 8e-4)
    slow_host = HardwareProfile(**{**ROUND.__dict__, "host_read_gbps": 20.0})
    assert predict(slow_host, MODEL, batch=8, routed=40, misses=10).binding == "host-read"
    with pytest.raises(ValueError, match="hidden"):
        predict(ROUND, MODEL, batch=8, routed=40, misses=10, hidden=1.5)
    # 3 prefetches no layer used (6 ms) hold the link too: the demand half lands after 20 ms
    # (sharing it with the prefetches), the prefetches' other 6 ms outlast the reads (1.2 ms)
    waste = predict(ROUND, MODEL, batch=8, routed=40, misses=10, admissions=2, hidden=0.5,
                    unused=3)
    assert waste.terms["t_unused"] == pytest.approx(0.006)
    assert waste.step_s == pytest.approx(0.026 + 0.004) and waste.binding == "pcie"
    with pytest.raises(ValueError, match="unused"):
        predict(ROUND, MODEL, batch=8, routed=40, misses=10, unused=-1)


def test_hosted_misses_run_beside_the_copies():
    host = HardwareProfile(**{**ROUND.__dict__, "host_kernel_gbps": 25.0})
    # 6 copied (12 ms) beside 3 hosted (12 ms), none prefetched: 1.2 + 12 ms
    p = predict(host, MODEL, batch=8, routed=40, misses=6, hosted=3)
    assert p.terms["t_host"] == pytest.approx(0.012)
    assert p.step_s == pytest.approx(1.2e-3 + 0.012)
    assert predict(host, MODEL, batch=8, routed=40, misses=1, hosted=6).binding == (
        "host-compute")
    with pytest.raises(ValueError, match="no host kernel rate"):
        predict(ROUND, MODEL, batch=8, routed=40, misses=1, hosted=1)
    # the split of misses.split: host at half the link's rate takes a third of 9 misses
    layer_misses = np.array([[9, 0], [3, 1]])
    np.testing.assert_array_equal(hosted_misses(host, MODEL, layer_misses, 1, "auto"),
                                  [[3, 0], [1, 0]])
    np.testing.assert_array_equal(hosted_misses(host, MODEL, layer_misses, 1, "host"),
                                  layer_misses)
    assert not hosted_misses(host, MODEL, layer_misses, 1, "fetch").any()


def test_disk_loads_stall_the_step_and_its_rerun():
    disk = HardwareProfile(**{**ROUND.__dict__, "disk_gbps": 2.0})
    base = predict(disk, MODEL, batch=8, routed=40, misses=10, admissions=2, hidden=0.5)
    # 3 loads of 1e8 bytes at 2 GB/s = 150 ms, waited for; half of the layers run again
    p = predict(disk, MODEL, batch=8, routed=40, misses=10, admissions=2, hidden=0.5,
                disk_loads=3, rerun=0.5)
    assert p.terms["t_disk"] == pytest.approx(0.15)
    # the admissions' copies (2 x 1e8 bytes) come once, after the step, not per re-run
    t_admit = p.terms["t_admit"]
    assert t_admit == pytest.approx(2e8 / (ROUND.link_gbps * 1e9))
    assert p.step_s == pytest.approx((base.step_s - t_admit) * 1.5 + t_admit + 0.15)
    assert p.binding == "disk"
    with pytest.raises(ValueError, match="no disk rate"):
        predict(ROUND, MODEL, batch=8, routed=40, misses=1, disk_loads=1)
    with pytest.raises(ValueError, match="rerun"):
        predict(disk, MODEL, batch=8, routed=40, misses=1, rerun=-1)


def test_profiles_and_model_cost():
    assert set(PROFILES) == {"h200-pcie5", "rtx3090-pcie3-xeon-v4", "rtx4090-pcie4"}
    assert profile("rtx3090-pcie3-xeon-v4").pcie_gbps == 12.0
    with pytest.raises(ValueError, match="shipped: h200-pcie5"):
        profile("a100")
    cfg = tiny_config(hidden_size=16, expert_intermediate_size=8, num_layers=2, num_experts=4,
                      top_k=2, vocab_size=10)
    cost = model_cost(cfg)
    dense = cfg.param_counts()["dense"] - 10 * 16  # the embedding table is gathered, not read
    assert cost.bytes_per_expert == 3 * 16 * 8 * 2
    assert cost.dense_bytes == 2 * dense
    assert cost.flops_per_token == 2 * (dense + 2 * 2 * 3 * 16 * 8)


def test_predict_replay_uses_decode_step_averages():
    t = SYNTHETIC["drifting"]
    r = simulate(t, "lfu", pinned=pinned_by_heat(t, 4), cache=6, staging=2)
    got = predict_replay(ROUND, MODEL, t, r, hidden=0.25)
    routed = r.accesses / t.num_steps
    want = predict(ROUND, MODEL, batch=3, routed=routed, misses=r.misses / t.num_steps,
                   admissions=r.admissions / t.num_steps, hidden=0.25)
    assert got.tok_s == pytest.approx(want.tok_s) and got.binding == want.binding
