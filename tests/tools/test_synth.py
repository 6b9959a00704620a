"""Synthetic checkpoints: shapes, determinism, routing skew, numerics."""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import strata_jax
from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.model.flax_model import MoEModel
from strata_jax.step import programs as step
from strata_jax.tools import synth
from strata_runtime.cli.main import main

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
    [("mixtral-8x7b", 46.7e9, 0.01), ("qwen3-30b-a3b", 30.5e9, 0.01), ("seed-125b", 125e9, 0.05),
     ("deepseek-v3", 671e9, 0.005), ("glm-4.5-air", 106e9, 0.01), ("minimax-m2", 230e9, 0.01),
     ("gpt-oss-20b", 20.9e9, 0.01), ("gpt-oss-120b", 116.8e9, 0.01),
     ("qwen3-next-80b-a3b", 79.7e9, 0.01)],
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


@pytest.mark.parametrize("bf16", [True, False])
def test_xla_kernel_matches_numpy(bf16: bool) -> None:
    """Blocks of at least `_MIN_XLA` elements run in XLA, shorter ones in numpy: same bits."""
    scale = np.float32(0.02)
    for piece in range(2):  # the second call overwrites the first's (donated) buffer
        a, b = synth._piece_key([3, 2, 1], piece)
        args = np.array([a, b, scale.view(np.uint32)], np.uint32)
        got = np.asarray(synth._xla_block(synth._BLOCK, bf16, args))
        np.testing.assert_array_equal(got, synth._values_np(a, b, synth._BLOCK, scale, bf16))
        del got


def test_blocking_does_not_change_values() -> None:
    """A piece of 1.5 M + 5 elements runs as blocks of 2^20, 2^19 and 5 (numpy)."""
    n = synth._BLOCK + synth._BLOCK // 2 + 5
    whole = synth.random_array((n,), np.dtype(np.float32), 0.3, [4, 4])
    a, b = synth._piece_key([4, 4], 0)
    scale = np.float32(0.3 / np.sqrt(synth._BYTE_SUM_VAR))
    np.testing.assert_array_equal(whole, synth._values_np(a, b, n, scale, False))


def test_random_values_distribution() -> None:
    std = 0.05
    x = synth.random_array((1 << 22,), np.dtype(np.float32), std, [11, 0]).astype(np.float64)
    z = x / std
    assert np.isfinite(z).all()
    assert abs(z.mean()) < 3e-3  # standard error 5e-4
    assert z.var() == pytest.approx(1.0, abs=4e-3)  # standard error 6.4e-4
    assert abs((z**3).mean()) < 5e-3  # symmetric
    assert (z**4).mean() == pytest.approx(2.7, abs=0.02)  # Irwin-Hall(4); a normal has 3
    assert np.abs(z).max() <= 510 / np.sqrt(21845) + 1e-6  # bounded tails, about 3.45 std
    counts = np.histogram(np.abs(z), bins=np.arange(0, 3.5, 0.25))[0]
    assert (np.diff(counts) < 0).all()  # unimodal: density falls away from the centre
    # bf16 is the float32 rounded to nearest even
    y = synth.random_array((1 << 22,), np.dtype(ml_dtypes.bfloat16), std, [11, 0])
    np.testing.assert_array_equal(y, x.astype(np.float32).astype(ml_dtypes.bfloat16))


def test_expert_array_into_buffer_is_identical() -> None:
    cfg = synth.SHAPES["tiny"]
    buf = np.full(synth.expert_shape(cfg, "w2"), 7, synth.numpy_dtype(cfg.dtype))
    synth.expert_array(cfg, 0, 1, 3, "w2", out=buf)
    np.testing.assert_array_equal(buf, synth.expert_array(cfg, 0, 1, 3, "w2"))


def test_pipeline_with_two_buffers_is_byte_identical(ckpts, tmp_path, monkeypatch) -> None:
    """Buffers are recycled only after their write: with 2 for 96 chunks, nothing changes."""
    monkeypatch.setattr(synth, "_window", lambda cfg, workers: 2)
    path = tmp_path / "two"
    synth.synthesize("tiny", path, workers=3, progress=False)
    assert _chunk_hashes(path) == _chunk_hashes(ckpts["uniform"])
    reader, ref = CheckpointReader(path), CheckpointReader(ckpts["uniform"])
    for layer in range(reader.config.num_layers):  # read_expert checks every sha256 too
        for (kind, got), (_, want) in zip(
            reader.iter_layer_experts(layer), ref.iter_layer_experts(layer), strict=True
        ):
            np.testing.assert_array_equal(got, want, err_msg=kind)


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
    for layer in range(a.config.num_layers):
        x, y = a.read_layer_dense(layer), b.read_layer_dense(layer)
        for name in x:
            np.testing.assert_array_equal(x[name], y[name])
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
    positions = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    live = jnp.ones((TOKENS.size,), jnp.bool_)
    kv = jnp.zeros((cfg.num_layers, *TOKENS.shape, cfg.num_kv_heads, cfg.head_dim),
                   jnp.bfloat16)
    module = MoEModel(cfg, step.StepPlan())
    run = jax.jit(functools.partial(module.apply, method=type(module).run_layers))
    x = run(model.params, model.params["params"]["embed"][TOKENS], positions, live,
            model.experts, step.resident_tiers(model.slot_table), kv, kv)[0]
    rms = float(jnp.sqrt(jnp.mean(x.astype(jnp.float32) ** 2)))
    assert np.isfinite(rms) and 1 < rms < 20


def test_cli_rejects_bad_skew(tmp_path, capsys) -> None:
    assert main(["synth", "--shape", "tiny", "--skew", "0.1", str(tmp_path / "x")]) == 2
    assert "skew must be in" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_deepseek_shaped_model_is_written_as_synthetic_model_builds_it(tmp_path,
                                                                        monkeypatch) -> None:
    """The writer's lanes carry the dense-MLP layers and MLA's params: the checkpoint loads to
    the model `synthetic_model` builds in memory, logits for logits."""
    from tests.helpers import tiny_config

    cfg = tiny_config("deepseek_v3", dtype="float32", vocab_size=300)
    monkeypatch.setitem(synth.SHAPES, "tiny-deepseek", cfg)
    stats = synth.synthesize("tiny-deepseek", tmp_path / "ds", dtype="float32", skew=0.5,
                             progress=False)
    assert stats.bytes == synth.checkpoint_bytes(cfg.replace(router_bias=True))
    written = strata_jax.load(tmp_path / "ds")
    assert written.config.dense_layers == 1 and written.config.attention == "mla"
    built = synth.synthetic_model(written.config, alpha=stats.alpha)
    np.testing.assert_array_equal(strata_jax.logits(written, TOKENS),
                                  strata_jax.logits(built, TOKENS))


def test_a_gpt_oss_shaped_model_keeps_its_alternation_and_expert_biases(tmp_path,
                                                                       monkeypatch) -> None:
    """`--layers` keeps the sliding layers it keeps; the expert lane writes the experts'
    biases: the checkpoint loads to `synthetic_model`'s model, logits for logits."""
    from tests.helpers import tiny_config

    cfg = tiny_config("gpt_oss", dtype="float32", vocab_size=300, num_layers=3,
                      sliding_layers=(0, 2))
    monkeypatch.setitem(synth.SHAPES, "tiny-gpt-oss", cfg)
    stats = synth.synthesize("tiny-gpt-oss", tmp_path / "go", layers=2, dtype="float32",
                             skew=0.5, progress=False)
    written = strata_jax.load(tmp_path / "go")
    assert written.config.sliding_layers == (0,) and written.config.num_layers == 2
    assert stats.bytes == synth.checkpoint_bytes(written.config)
    assert written.experts.b2.shape == (2 * cfg.num_experts, cfg.hidden_size)
    built = synth.synthetic_model(written.config, alpha=stats.alpha)
    np.testing.assert_array_equal(strata_jax.logits(written, TOKENS),
                                  strata_jax.logits(built, TOKENS))


def test_a_qwen3_next_shaped_model_keeps_its_pattern_and_token_mixers(tmp_path,
                                                                      monkeypatch) -> None:
    """`--layers` keeps the linear layers it keeps (the real shape's three of every four);
    the dense lane writes each kind's token mixers: the checkpoint loads to
    `synthetic_model`'s model, logits for logits."""
    from tests.helpers import tiny_config

    real = synth.synth_config("qwen3-next-80b-a3b", layers=6)
    assert real.linear_layers == (0, 1, 2, 4, 5) and real.attention_layers == 1
    cfg = tiny_config("qwen3_next", dtype="float32", vocab_size=300, num_layers=4,
                      linear_layers=(0, 1, 2))
    monkeypatch.setitem(synth.SHAPES, "tiny-qwen3-next", cfg)
    stats = synth.synthesize("tiny-qwen3-next", tmp_path / "qn", layers=3, dtype="float32",
                             progress=False)
    written = strata_jax.load(tmp_path / "qn")
    assert written.config.linear_layers == (0, 1, 2) and written.config.attention_layers == 0
    assert stats.bytes == synth.checkpoint_bytes(written.config)
    built = synth.synthetic_model(written.config)
    np.testing.assert_array_equal(strata_jax.logits(written, TOKENS),
                                  strata_jax.logits(built, TOKENS))


def test_plan_of_a_full_size_shape_counts_the_latent_cache(capsys) -> None:
    """`strata plan --shape` plans a model no one has on disk; DeepSeek-V3's cache is the MLA
    latent: 61 layers x (512 + 64) bf16 values a token."""
    from strata_runtime.cli.main import main

    assert main(["plan", "--shape", "deepseek-v3", "--experts", "int4", "--dense", "int8",
                 "--hbm", "80GB", "--host-mem", "512GB", "--workspace", "8GB",
                 "--max-len", "1024", "--batch-capacity", "4"]) == 0
    out = capsys.readouterr().out
    kv = 4 * 1024 * 61 * (512 + 64) * 2
    assert f"{kv:,}" in out and "tier 1  pinned host" in out


def test_the_cli_offers_every_shape():
    """`strata synth/plan --shape` name the shapes without importing synth: the same set."""
    from strata_runtime.cli.tools import SHAPE_NAMES

    assert set(SHAPE_NAMES) == set(synth.SHAPES)
