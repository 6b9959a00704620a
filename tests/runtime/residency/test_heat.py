"""Routing-statistics files: recorded by one run, they rank the tiers of the next."""

import json

import numpy as np
import pytest

from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.tools.synth import synthesize
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.residency.heat import load_heat, save_heat
from tests.runtime.contract import run_rows

PROMPTS = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6]]


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    path = tmp_path_factory.mktemp("heat") / "skewed"
    synthesize("tiny", path, skew=0.85, seed=7, dtype="float32", progress=False)
    return path


def _run(ckpt, **knobs):
    config = EngineConfig(batch_capacity=4, max_len=48, policy="static", predictor="none",
                          **knobs)
    with Engine.from_checkpoint(ckpt, config) as engine:
        tokens, logits = run_rows(engine, PROMPTS, 24)
    return tokens, logits, engine


def test_recorded_heat_pins_the_hot_experts(skewed, tmp_path):
    cfg = CheckpointReader(skewed).config
    total = cfg.num_layers * cfg.num_experts
    ref_tokens, ref_logits, _ = _run(skewed)
    uniform_tokens, _, uniform = _run(skewed, resident_experts=total // 4)
    uniform.save_heat(tmp_path / "heat.json")
    counts = load_heat(tmp_path / "heat.json", uniform.cfg)
    assert counts.sum() > 0 and counts.max() > 3 * counts.mean()  # skewed routing recorded
    tokens, logits, hot = _run(skewed, resident_experts=total // 4,
                               heat_file=str(tmp_path / "heat.json"))
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_array_equal(uniform_tokens, ref_tokens)
    np.testing.assert_array_equal(logits, ref_logits)
    pinned = {k for k in hot.residency.slot_key if k is not None}
    assert len(pinned) == total // 4
    outside = set(np.ndindex(counts.shape)) - pinned
    assert min(counts[k] for k in pinned) >= max(counts[k] for k in outside)
    assert hot.stats()["tier0_hit_rate"] > uniform.stats()["tier0_hit_rate"] + 0.2


def test_bad_heat_files_are_named(skewed, tmp_path):
    cfg = CheckpointReader(skewed).config
    save_heat(tmp_path / "small.json", np.ones((1, 2)))
    with pytest.raises(ValueError, match=r"small.json: counts of shape \(1, 2\)"):
        load_heat(tmp_path / "small.json", cfg)
    (tmp_path / "other.json").write_text(json.dumps({"counts": []}))
    with pytest.raises(ValueError, match="other.json is not a routing-statistics file"):
        load_heat(tmp_path / "other.json", cfg)
    with pytest.raises(ValueError, match="cannot read routing statistics"):
        load_heat(tmp_path / "missing.json", cfg)
