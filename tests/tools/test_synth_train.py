"""Training synthetic checkpoints on a Markov language (`strata synth --train-steps`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.special

import strata_jax
from strata_jax.formats.checkpoint import FLOAT, CheckpointReader
from strata_jax.tools import synth, synth_train
from strata_runtime.cli.main import main

STEPS = 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("synth_train") / "tiny"
    argv = ["synth", "--shape", "tiny", "--layers", "2", "--dtype", "float32"]
    assert main([*argv, "--train-steps", str(STEPS), str(dst)]) == 0
    return dst


def _meta(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _heldout_loss(model: strata_jax.Model, seed: int = 0) -> float:
    """Next-token cross-entropy on fresh sequences of the seed-0 language."""
    succ = synth_train.markov_successors(model.config.vocab_size, seed)
    tokens = synth_train.markov_batch(succ, np.random.default_rng(99), (16, 32))
    logp = scipy.special.log_softmax(strata_jax.logits(model, tokens[:, :-1]), axis=-1)
    return float(-np.take_along_axis(logp, tokens[:, 1:, None], -1).mean())


def test_loss_falls_toward_language_entropy(trained):
    t = _meta(trained)["trained"]
    floor, flat = synth_train.language_entropy(), math.log(512)
    loss = _heldout_loss(strata_jax.load(trained))
    print(f"loss {t['initial_loss']:.3f} -> {t['final_loss']:.3f} in {t['steps']} steps, "
          f"held-out {loss:.3f} (entropy {floor:.3f}, log vocab {flat:.3f})")  # fmt: skip
    assert t["steps"] == STEPS and t["language_entropy"] == pytest.approx(1.1319, abs=1e-4)
    assert t["initial_loss"] > 0.9 * flat
    assert floor < t["final_loss"] < flat / 3
    assert loss == pytest.approx(t["final_loss"], abs=0.25)  # the stored weights are the trained


def test_generation_follows_the_successors(trained):
    model = strata_jax.load(trained)
    succ = synth_train.markov_successors(model.config.vocab_size, seed=0)
    starts = np.random.default_rng(5).integers(0, model.config.vocab_size, 32)
    out = strata_jax.generate(model, [[int(s)] for s in starts], 8)
    seqs = np.concatenate([starts[:, None], np.array(out)], axis=1)
    prev, nxt = seqs[:, :-1], seqs[:, 1:]
    follows = (succ[prev] == nxt[..., None]).any(-1).mean()
    top = (succ[prev, 0] == nxt).mean()
    print(f"greedy steps to a successor: {100 * follows:.1f} % (chance 0.8 %), "
          f"to the most likely one {100 * top:.1f} %")  # fmt: skip
    assert follows >= 0.8 and top >= 0.5


def test_rewritten_checkpoint_is_valid(trained):
    meta = _meta(trained)
    assert meta["synthetic"] == {"shape": "tiny", "seed": 0, "skew": None, "alpha": 0.0}
    assert meta["quantization"] == FLOAT and meta["dtype"] == "float32"
    assert not list(trained.parent.glob("*.partial-*"))
    reader = CheckpointReader(trained)
    cfg = reader.config
    assert cfg == synth.synth_config("tiny", layers=2, dtype="float32")
    for li in range(cfg.num_layers):
        for e in range(cfg.num_experts):
            for kind in reader.expert_specs:
                reader.read_expert(li, e, kind)  # checks every chunk's hash
    dense, fresh = reader.read_layer_dense(1), synth.layer_params(cfg, 0, 1)
    np.testing.assert_array_equal(dense["router_bias"], fresh["router_bias"])  # frozen
    assert not np.allclose(dense["router"], fresh["router"])
    assert not np.allclose(reader.read_expert(1, 3, "w2"), synth.expert_array(cfg, 0, 1, 3, "w2"))


def test_bfloat16_checkpoint_is_stored_back_in_bfloat16(tmp_path):
    dst = tmp_path / "bf16"
    stats = synth.synthesize("tiny", dst, layers=2, dtype="bfloat16", progress=False,
                             train_steps=2)  # fmt: skip
    assert stats.trained["steps"] == 2 and "trained 2 steps" in str(stats)
    reader = CheckpointReader(dst)
    assert reader.meta["dtype"] == "bfloat16" and reader.meta["trained"] == stats.trained
    embed = reader.read_globals()["embed"]
    assert embed.dtype.name == "bfloat16"
    assert not np.array_equal(embed, synth.global_params(reader.config, 0)["embed"])


def test_bad_inputs_are_refused(trained, tmp_path, capsys):
    dst = tmp_path / "big"
    with pytest.raises(ValueError, match="training is for tiny test models"):
        synth.synthesize("mixtral-8x7b", dst, layers=1, train_steps=1, progress=False)
    assert main(["synth", "--shape", "qwen3-30b-a3b", "--train-steps", "5", str(dst)]) == 2
    assert "at most 50 M" in capsys.readouterr().err
    assert not dst.exists()
    with pytest.raises(ValueError, match="must be >= 1"):
        synth_train.train_synthetic(trained, 0)
