"""The engine's counters per phase: decode steps and prefill chunks counted apart, the totals
their sum, and the cost model's prediction fed by the decode steps alone."""

from dataclasses import fields

import numpy as np
import pytest

from strata_jax.batching import packing
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.engine.stats import PhaseCounts, render
from strata_runtime.lab.cost_model import HardwareProfile, run_prediction
from strata_runtime.lab.counting import Counts
from strata_runtime.lab.facts import EngineFacts
from tests.helpers import tiny_config, write_checkpoint

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]
NEW = 6
RECORDED = ("routed", "hits", "prefetched", "fetched", "hosted", "issued")  # per layer too
HW = HardwareProfile(name="test", pcie_gbps=10.0, host_read_gbps=20.0, hbm_gbps=100.0,
                     hbm_gib=1.0, matmul_tflops=1.0, host_cores=2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 of the 12 experts in HBM (one as a cache slot, admitting every demand copy), tier 1
    only what one layer's disk misses need: prefill chunks and decode steps both stall on
    disk and admit to the cache."""
    path = tmp_path_factory.mktemp("stats") / "ck"
    write_checkpoint(tiny_config("qwen2_moe"), path, seed=5)
    config = EngineConfig(batch_capacity=4, max_len=32, resident_experts=3, host_experts=0,
                          cache_fraction=0.34, cache_admit="always")
    with Engine.from_checkpoint(path, config) as engine:
        out = engine.generate(PROMPTS, NEW)
        stats = engine.stats()  # observes the last step's record
        facts = EngineFacts.of(engine)
        counts = Counts.of(facts.counters(), 1.0, sum(len(t) for t in out))
        predicted = run_prediction(counts, facts.sizes, HW, facts.cfg.num_layers)
        per_layer = {k: int(v.sum()) for k, v in engine.counters.per_layer.items()}
        decode_tokens = engine.counters.decode_tokens
    return stats, counts, predicted, per_layer, decode_tokens


def test_each_phase_is_counted_and_the_totals_are_their_sum(run):
    stats, counts, _, per_layer, _ = run
    decode, prefill = stats["by_phase"]["decode"], stats["by_phase"]["prefill"]
    # one packed program: the 9- and 3-token prompts' 16-token chunks; another: the 1-token one
    assert prefill["calls"] == len(packing.pack([len(p) for p in PROMPTS], 32, 4)) == 2
    assert decode["calls"] == stats["decode_steps"] + 1 > 1  # the compiling step is a call
    assert counts.prefill_chunks == prefill["calls"]
    names = set(decode["totals"])
    assert names == set(prefill["totals"]) == {f.name for f in fields(PhaseCounts)} - {"calls"}
    for phase in (decode, prefill):  # both phases routed, copied, stalled on disk, admitted
        for name in ("routed", "fetched", "disk_loads", "disk_stall_s", "resumed_layers",
                     "admissions"):
            assert phase["totals"][name] > 0, name
        for name, total in phase["totals"].items():
            assert phase["per_call"][name] == pytest.approx(total / phase["calls"])
    summed = {n: decode["totals"][n] + prefill["totals"][n] for n in names}
    for name in RECORDED:  # the per-layer sums are kept apart from the phases
        assert per_layer[name] == summed[name], name
    for name in ("disk_loads", "resumed_layers", "admissions"):
        assert stats[name] == summed[name], name
    assert stats["disk_stall_s"] == pytest.approx(summed["disk_stall_s"])
    bpe = stats["disk_bytes"] // stats["disk_loads"]
    assert stats["h2d_bytes"] == (summed["fetched"] + summed["issued"]
                                  + summed["admissions"]) * bpe
    assert stats["tier0_hit_rate"] == pytest.approx(summed["hits"] / summed["routed"])
    (device,) = stats["devices"]  # one device: its share is everything
    for name in ("hits", "fetched", "issued", "admissions", "disk_loads", "h2d_bytes"):
        assert device[name] == (stats if name == "h2d_bytes" else summed)[name], name
    assert device["link_busy"] == stats["link_busy"]
    for name in names:  # the bench's all-phase counts too
        assert getattr(counts.total, name) == pytest.approx(summed[name]), name
        assert getattr(counts.decode, name) == decode["totals"][name], name
    text = render(stats)
    assert "by_phase:" in text and "    prefill:" in text and "per_call" in text


def test_the_prediction_reads_the_decode_steps_alone(run):
    stats, _, predicted, _, decode_tokens = run
    d = stats["by_phase"]["decode"]
    total, steps = d["totals"], d["calls"]
    inputs = predicted["inputs"]
    need = total["fetched"] + total["prefetched"]
    bpe = stats["disk_bytes"] / stats["disk_loads"]
    expected = {"batch": decode_tokens / stats["decode_steps"],
                "routed": total["routed"] / steps, "misses": need / steps,
                "hosted": total["hosted"] / steps, "admissions": total["admissions"] / steps,
                "disk_loads": total["disk_loads"] / steps,
                "rerun": total["resumed_layers"] / (2 * steps),
                "hidden": total["prefetched"] / need,
                "disk_gbps": total["disk_loads"] * bpe / total["disk_stall_s"] / 1e9}
    for name, value in expected.items():
        assert inputs[name] == pytest.approx(value), name
    assert inputs["routed"] == pytest.approx(d["per_call"]["routed"])
    assert inputs["disk_loads"] > 0 and inputs["rerun"] > 0
    # the prefill chunks' share would move the disk figures: they are not in the inputs
    both = {n: total[n] + stats["by_phase"]["prefill"]["totals"][n]
            for n in ("disk_loads", "disk_stall_s")}
    mixed_rate = both["disk_loads"] * bpe / both["disk_stall_s"] / 1e9
    assert not np.isclose(inputs["disk_gbps"], mixed_rate, rtol=1e-6)


def test_a_resident_steps_call_counts_as_host_launch_time(tmp_path):
    """A resident decode program returns before it ends, so its call is host work serial with
    the engine's own (`launch_s`, the cost model's t_engine); a staged one's call is not."""
    from strata_runtime.engine.config import EngineConfig
    from strata_runtime.engine.offload import Engine
    from tests.helpers import tiny_config, write_checkpoint

    write_checkpoint(tiny_config(), tmp_path / "ck", seed=4)
    for knobs, launches in (({}, True), ({"resident_experts": 2}, False)):
        with Engine.from_checkpoint(tmp_path / "ck", EngineConfig(
                batch_capacity=2, max_len=32, **knobs)) as engine:
            engine.generate([[1, 2, 3]], 6)
            c = engine.counters
            assert c.decode_steps > 0 and c.dispatch_s > 0
            assert (c.launch_s == c.dispatch_s) if launches else c.launch_s == 0
