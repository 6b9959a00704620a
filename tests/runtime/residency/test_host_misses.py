"""Misses computed on the host (`EngineConfig.miss`): within a stated tolerance of the resident
run (host compute rounds differently; docs/design.md, "Host compute of misses"), the split
seen in the stats, and clear refusals."""

import json

import numpy as np
import pytest

from strata_runtime.cli import main as cli
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from tests.helpers import tiny_config, write_checkpoint
from tests.runtime.contract import run_rows

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]
SHAPE = dict(batch_capacity=4, max_len=32)
F32_TOL = 1e-4  # of the logits' spread: float32 experts, host vs device accumulation order


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("host_misses") / "ck"
    write_checkpoint(tiny_config("qwen2_moe"), path, seed=5)
    return path


@pytest.fixture(scope="module")
def reference(ckpt):
    with Engine.from_checkpoint(ckpt, EngineConfig(**SHAPE)) as engine:
        return run_rows(engine, PROMPTS, 6)


@pytest.mark.parametrize(("knobs", "fetches"), [
    (dict(miss="auto", miss_rates="link=10,host=10"), True),
    # every miss on the host, and a tier 1 of half the offloaded experts: disk stalls resume
    # with host compute on
    (dict(miss="host", host_experts=5), False)])
def test_host_compute_is_within_tolerance_of_resident(ckpt, reference, knobs, fetches):
    ref_tokens, ref_logits = reference
    with Engine.from_checkpoint(ckpt, EngineConfig(**SHAPE, resident_experts=2,
                                                   policy="static", **knobs)) as engine:
        tokens, logits = run_rows(engine, PROMPTS, 6)
        stats = engine.stats()
    np.testing.assert_array_equal(tokens, ref_tokens)
    spread = np.abs(ref_logits).max()
    assert np.abs(logits - ref_logits).max() <= F32_TOL * spread
    assert stats["hosted_per_step"] > 0 and stats["host_compute_s"] > 0
    assert stats["host_round_trips"] > 0 and stats["host_kernel_ms"] > 0
    assert stats["host_queue_ms"] >= 0 and stats["host_wait_ms"] >= 0
    assert (stats["misses_per_step"] > 0) == fetches
    if knobs.get("miss_rates"):
        assert stats["miss_rates"] == "link=10,host=10,row=0"
    if "host_experts" in knobs:
        assert stats["disk_loads"] > 0


def test_the_timeline_shows_each_layers_host_share(ckpt, tmp_path):
    config = EngineConfig(**SHAPE, resident_experts=2, policy="static", miss="host",
                          timeline=True)
    with Engine.from_checkpoint(ckpt, config) as engine:
        run_rows(engine, PROMPTS[:1], 2)
        trips = engine.stats()["host_round_trips"]
        engine.export_timeline(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    kernel = [e for e in events if e["name"] == "host experts"]
    assert trips > 0 and len(kernel) == trips
    assert {lanes[e["tid"]] for e in kernel} == {"host kernel"}
    assert all(e["dur"] >= 0 and int(e["args"]["experts"]) >= 1 for e in kernel)
    assert len([e for e in events if e["name"] == "device waits for the host"]) == trips


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny synthetic Mixtral shape in bfloat16, trained on its Markov language."""
    path = tmp_path_factory.mktemp("host_misses") / "trained"
    assert cli.main(["synth", "--shape", "tiny", "--layers", "2", "--dtype", "bfloat16",
                     "--train-steps", "40", str(path)]) == 0
    return path


def test_greedy_agreement_on_a_trained_model(trained):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, 6).tolist() for _ in range(8)]
    shape = dict(batch_capacity=8, max_len=32)
    with Engine.from_checkpoint(trained, EngineConfig(**shape)) as engine:
        ref, _ = run_rows(engine, prompts, 12)
    with Engine.from_checkpoint(trained, EngineConfig(**shape, resident_experts=8,
                                                      miss="host")) as engine:
        got, _ = run_rows(engine, prompts, 12)
        stats = engine.stats()
    agree = (got == ref).mean()
    print(f"greedy agreement {agree:.3f}, {stats['hosted_per_step']:.1f} experts per step "
          "on the host")
    assert stats["hosted_per_step"] > 4
    assert agree >= 0.9


def test_bad_knobs_are_refused():
    with pytest.raises(ValueError, match="miss must be one of"):
        EngineConfig(miss="gpu")
    with pytest.raises(ValueError, match="give host"):
        EngineConfig(miss="auto", miss_rates="link=4")
