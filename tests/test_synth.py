"""Synthetic checkpoints: shapes, determinism, routing skew, numerics."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import strata_jax
from strata_jax import model as mdl
from strata_jax import synth
from strata_jax.checkpoint import CheckpointReader
from strata_jax.cli import main

TOKENS = np.arange(24, dtype=np.int32).reshape(2, 12) * 7 % 512


def _synth(tmp: Path, name: str, *args: str) -> Path:
    dst = tmp / name
    assert main(["synth", "--shape", "tiny", *args, str(dst)]) == 0
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("synth")
    return {
        "uniform": _synth(tmp, "uniform"),
        "skew60": _synth(tmp, "skew60", "--skew", "0.6"),
        "skew80": _synth(tmp, "skew80", "--skew", "0.8"),
        "seed1": _synth(tmp, "seed1", "--seed", "1"),
    }


def _chunk_hashes(path: Path) -> dict[str, str]:
    return json.loads((path / "manifest.json").read_text())["expert_chunks"]


@pytest.mark.parametrize(
    ("shape", "total", "rel"),
    [("mixtral-8x7b", 46.7e9, 0.01), ("qwen3-30b-a3b", 30.5e9, 0.01), ("seed-125b", 125e9, 0.05)],
)
def test_param_counts(shape: str, total: float, rel: float) -> None:
    assert synth.SHAPES[shape].param_counts()["total"] == pytest.approx(total, rel=rel)


def test_seed_125b_split() -> None:
    counts = synth.SHAPES["seed-125b"].param_counts()
    assert counts["dense"] == pytest.approx(30e9, rel=0.05)
    assert counts["routed"] == pytest.approx(95e9, rel=0.05)


def test_tiny_in_dims_fit_int4_groups() -> None:
    cfg = synth.SHAPES["tiny"]
    for dim in (cfg.hidden_size, cfg.q_size, cfg.expert_intermediate_size):
        assert dim % 128 == 0


def test_top_share_interpolates() -> None:
    counts = np.array([0, 3, 0, 4, 1, 0, 0, 2])  # E=8 -> top 1.6 experts: 4 + 0.6 * 3
    assert synth.top_share(counts) == pytest.approx((4 + 0.6 * 3) / 10)
    assert synth.top_share(np.full(10, 5)) == pytest.approx(0.2)


def test_skew_beyond_reach_is_rejected() -> None:
    assert synth.max_top_share(8, 2) == pytest.approx(0.8)  # top 1.6 of 8 experts, top-2
    with pytest.raises(ValueError, match="skew must be in"):
        synth.calibrate_alpha(8, 2, 0.85)


def test_random_array_independent_of_threads() -> None:
    args = ((3, synth.PIECE + 5), np.dtype(np.float32), 0.5, [7, 1, 2])
    with ThreadPoolExecutor(3) as pool:
        threaded = synth.random_array(*args, pool=pool)
    plain = synth.random_array(*args)
    np.testing.assert_array_equal(threaded, plain)
    assert threaded.std() == pytest.approx(0.5, rel=0.01)


@pytest.mark.parametrize(("name", "target"), [("skew60", 0.6), ("skew80", 0.8)])
def test_skew_reaches_target(ckpts, name: str, target: float) -> None:
    share = synth.measure_top20_share(strata_jax.load(ckpts[name]), num_tokens=2000)
    assert share == pytest.approx(target, abs=0.05)


def test_no_skew_is_near_uniform(ckpts) -> None:
    cfg = synth.SHAPES["tiny"]
    uniform = synth.expected_top_share(cfg.num_experts, cfg.top_k, alpha=0.0, num_tokens=2000)
    assert 0.2 < uniform < 0.23  # finite-sample noise lifts the Lorenz value a little
    share = synth.measure_top20_share(strata_jax.load(ckpts["uniform"]), num_tokens=2000)
    assert share == pytest.approx(uniform, abs=0.05)


def test_same_seed_is_byte_identical(ckpts, tmp_path) -> None:
    again = tmp_path / "again"
    synth.synthesize("tiny", again, workers=1, progress=False)  # other thread count
    assert _chunk_hashes(again) == _chunk_hashes(ckpts["uniform"])
    a, b = CheckpointReader(again), CheckpointReader(ckpts["uniform"])
    np.testing.assert_array_equal(a.read_expert(1, 3, "w2"), b.read_expert(1, 3, "w2"))
    for x, y in zip(a.read_dense_stacked().values(), b.read_dense_stacked().values(), strict=True):
        np.testing.assert_array_equal(x, y)
    logits_a = strata_jax.logits(strata_jax.load(again), TOKENS)
    np.testing.assert_array_equal(
        logits_a, strata_jax.logits(strata_jax.load(ckpts["uniform"]), TOKENS)
    )


def test_different_seed_differs(ckpts) -> None:
    a, b = _chunk_hashes(ckpts["uniform"]), _chunk_hashes(ckpts["seed1"])
    assert a.keys() == b.keys()
    assert not set(a.values()) & set(b.values())
    la = strata_jax.logits(strata_jax.load(ckpts["uniform"]), TOKENS)
    lb = strata_jax.logits(strata_jax.load(ckpts["seed1"]), TOKENS)
    assert not np.allclose(la, lb)


def test_layers_override_and_generation(tmp_path) -> None:
    path = _synth(tmp_path, "deep", "--layers", "3", "--skew", "0.7")
    model = strata_jax.load(path)
    assert model.config.num_layers == 3 and model.config.router_bias
    assert np.isfinite(strata_jax.logits(model, TOKENS)).all()
    out = strata_jax.generate(model, [[1, 2, 3], [4, 5]], 6)
    assert [len(o) for o in out] == [6, 6]
    assert all(0 <= t < model.config.vocab_size for o in out for t in o)


def test_deep_bf16_activations_stay_finite() -> None:
    """32 bf16 layers keep the residual stream O(1)-ish (init std 1/sqrt(fan_in))."""
    cfg = synth.synth_config("tiny", layers=32)
    model = synth.synthetic_model(cfg, seed=3)
    layer = jax.jit(mdl._causal_layer, static_argnums=0)  # one compile, 32 calls
    positions = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    x = model.params["embed"][TOKENS]
    for i, lp in enumerate(model.params["layers"]):
        x = layer(cfg, lp, x, positions, model.experts, model.slot_table[i])[0]
    rms = float(jnp.sqrt(jnp.mean(x.astype(jnp.float32) ** 2)))
    assert np.isfinite(rms) and 1 < rms < 20


def test_cli_rejects_bad_skew(tmp_path, capsys) -> None:
    assert main(["synth", "--shape", "tiny", "--skew", "0.1", str(tmp_path / "x")]) == 2
    assert "skew must be in" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
