"""Acceptance tests for `strata quantize` and `strata eval quant`, run through the real CLI on
tiny models: (i) a synthetic one with random weights, (ii) the same synthetic model trained for
a few seconds on a small Markov language (`strata synth --train-steps`), and (iii) a tiny
transformers Mixtral, converted with `strata convert hf`, trained the same way.

Why train: a random-weight model's next-token distribution is nearly flat (its top-1 and top-2
logits are a small fraction of the logit spread apart), so *any* weight perturbation flips many
argmaxes: on the random synthetic model, int4 experts alone (RTN) keep ~80 % top-1 agreement and
even int8 dense weights alone only ~98 %. A trained model is confident where its data is, like
real LMs, and its held-out tokens are then realistic ones: sequences sampled from the model. The
95 % top-1 bound is asserted on (ii) and (iii); on (i) GPTQ must beat RTN instead.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import strata_jax
from strata_jax.formats import quant
from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.tools import gptq, quantize
from strata_jax.tools.quantize import (
    PAD_TOKEN,
    REPORT_FILE,
    CalibrationWarning,
    calibration_tokens,
    quantize_checkpoint,
    read_token_file,
    read_token_sequences,
)
from strata_jax.tools.synth import synthesize
from strata_jax.tools.synth_train import language_entropy, markov_batch, markov_successors
from strata_runtime.cli import main as cli
from tests.helpers import tiny_config, write_checkpoint

QUANTIZED = {"dense": "int8", "experts": "int4-g128"}
CALIB_SEQS, HELDOUT_SEQS = "64", "32"
MIN_HELDOUT = 32  # held-out tokens an expert needs to take part in the GPTQ-vs-RTN comparison
VOCAB = 256  # the Markov language (synth_train) of model (ii)
TRAIN_STEPS, TRAIN_BATCH = 40, (32, 32)


# --------------------------------------------------------------------------------- models


def trained_mixtral(path: Path, seed: int = 0) -> None:
    """A tiny Mixtral (hidden 128, expert FFN 128, 8 experts top-2) trained briefly, saved."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=VOCAB, hidden_size=128, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, eos_token_id=None, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("mlp.gate.weight"):  # router: logits of std ~1 at init
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.02)
    succ, rng = markov_successors(VOCAB, seed), np.random.default_rng([seed, 1])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only contend
    try:
        model.train()
        for _ in range(TRAIN_STEPS):
            x = torch.from_numpy(markov_batch(succ, rng, TRAIN_BATCH)).long()
            loss = model(x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    print(f"trained mixtral: final loss {loss.item():.3f} "
          f"(language entropy {language_entropy():.3f})")  # fmt: skip
    model.eval().save_pretrained(path)


# ---------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """A float checkpoint, its int8 + int4-GPTQ quantization, and `strata eval quant` output."""

    name: str
    src: Path
    dst: Path
    report: dict
    eval: dict


def run(*argv: str) -> None:
    assert cli.main([str(a) for a in argv]) == 0


def quantize_and_eval(name: str, src: Path, root: Path) -> Case:
    dst, out = root / f"{name}.q", root / f"{name}.eval.json"
    run("quantize", src, dst, "--experts", "int4-gptq", "--dense", "int8",
        "--calib", CALIB_SEQS)  # fmt: skip
    run("eval", "quant", dst, "--ref", src, "--tokens", HELDOUT_SEQS, "--seed", "1",
        "--min-expert-tokens", MIN_HELDOUT, "--json", out)  # fmt: skip
    report = json.loads((dst / REPORT_FILE).read_text())
    return Case(name, src, dst, report, json.loads(out.read_text()))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quantize")


@pytest.fixture(scope="module")
def synth_case(root) -> Case:
    src = root / "synth"
    synthesize("tiny", src, layers=2, seed=0, dtype="float32", progress=False)
    return quantize_and_eval("synth", src, root)


@pytest.fixture(scope="module")
def trained_synth_case(root) -> Case:
    src = root / "synth_trained"
    synthesize("tiny", src, layers=2, seed=0, dtype="float32", progress=False,
               train_steps=TRAIN_STEPS)  # fmt: skip
    return quantize_and_eval("synth_trained", src, root)


@pytest.fixture(scope="module")
def hf_case(root) -> Case:
    hf, src = root / "mixtral_hf", root / "mixtral"
    trained_mixtral(hf)
    run("convert", "hf", hf, src)
    return quantize_and_eval("mixtral", src, root)


@pytest.fixture(params=["synth", "mixtral"])
def case(request) -> Case:
    return request.getfixturevalue("synth_case" if request.param == "synth" else "hf_case")


# ------------------------------------------------------------------------------ acceptance


def test_gptq_beats_rtn_on_held_out_routed_tokens(case):
    ex = case.eval["experts"]
    print(
        f"{case.name}: GPTQ < RTN for {100 * ex['better_than_rtn_fraction']:.1f} % of "
        f"{ex['evaluated']}/{ex['total']} experts, mean error ratio {ex['mean_error_ratio']:.3f} "
        f"(RTN {ex['mean_rtn_error']:.4f}, GPTQ {ex['mean_quantized_error']:.4f})"
    )
    assert ex["evaluated"] >= 0.75 * ex["total"]
    assert ex["better_than_rtn_fraction"] >= 0.9
    assert case.report["expert_methods"].get("gptq", 0) >= 0.9 * ex["total"]


@pytest.mark.parametrize("trained_case", ["trained_synth_case", "hf_case"])
def test_top1_agreement_of_trained_model(trained_case, request):
    case = request.getfixturevalue(trained_case)
    ev = case.eval
    print(f"{case.name}: top-1 agreement {100 * ev['top1_agreement']:.2f} %, "
          f"KL {ev['kl_mean']:.3g} over {ev['positions']} positions")  # fmt: skip
    assert ev["top1_agreement"] >= 0.95


def test_gptq_agrees_better_than_rtn_on_random_model(synth_case, root):
    """Flat random logits: no absolute bound (see module doc), but GPTQ must beat RTN."""
    rtn, out = root / "synth.rtn", root / "synth.rtn.json"
    run("quantize", synth_case.src, rtn, "--experts", "int4-rtn", "--dense", "int8")
    run("eval", "quant", rtn, "--ref", synth_case.src, "--tokens", HELDOUT_SEQS, "--seed", "1",
        "--json", out)  # fmt: skip
    g, r = synth_case.eval, json.loads(out.read_text())
    print(
        f"synth: top-1 agreement GPTQ {100 * g['top1_agreement']:.2f} % vs RTN "
        f"{100 * r['top1_agreement']:.2f} %, KL {g['kl_mean']:.3g} vs {r['kl_mean']:.3g}"
    )
    assert g["kl_mean"] < r["kl_mean"] and g["top1_agreement"] >= r["top1_agreement"]


def test_quantized_checkpoint_loads(case):
    meta = json.loads((case.dst / "config.json").read_text())
    assert meta["quantization"] == QUANTIZED
    assert meta["quantize"]["experts"] == "int4-gptq" and meta["quantize"]["dense"] == "int8"
    assert meta["quantize"]["fallbacks"] == case.report["fallbacks"]
    model = strata_jax.load(case.dst)
    assert model.experts.quantized and model.experts.w1.dtype == np.uint8
    assert model.params["params"]["layers"]["wqkv"].dtype == np.int8


def test_quantized_model_generates(hf_case):
    """Greedy generation through prefill + decode (one model: the path is the same for both)."""
    model = strata_jax.load(hf_case.dst)
    out = strata_jax.generate(model, [[1, 2, 3], [4, 5]], 6)
    assert [len(o) for o in out] == [6, 6]
    assert all(0 <= t < model.config.vocab_size for o in out for t in o)


@pytest.fixture(scope="module")
def calib_file(root) -> Path:
    path = root / "calib.npy"
    np.save(path, np.random.default_rng(3).integers(0, 512, (24, 64)))
    return path


def test_calibration_file_and_rtn_fallback(synth_case, root, calib_file):
    """A .npy calibration file works; experts under the token threshold are RTN and listed.

    Also runs the dense GPTQ and act-order paths (int8-gptq, --act-order).
    """
    dst = root / "synth.file.q"
    run("quantize", synth_case.src, dst, "--calib", calib_file, "--dense", "int8-gptq",
        "--act-order")  # fmt: skip
    report = json.loads((dst / REPORT_FILE).read_text())
    assert "calib.npy" in report["calibration"] and report["calib_tokens"] == 32 * 64
    assert {m for _, _, m in report["dense"]} == {"gptq"} and len(report["dense"]) == 2 * 4
    assert report["options"]["act_order"] and report["options"]["dense"] == "int8-gptq"
    experts = report["experts"]
    threshold = 2 * 128  # default: 2 * K, K = 128 for w1/w3 and w2
    expected = [[r["layer"], r["expert"], r["tokens"]] for r in experts if r["tokens"] < threshold]
    print(f"{len(expected)}/{len(experts)} experts below {threshold} calibration tokens")
    assert 0 < len(expected) < len(experts)
    assert report["fallbacks"] == expected
    assert json.loads((dst / "config.json").read_text())["quantize"]["fallbacks"] == expected
    src, out = CheckpointReader(synth_case.src), CheckpointReader(dst)
    for r in experts:
        rtn = quant.quantize_int4_rtn(src.read_expert(r["layer"], r["expert"], "w1"))
        stored = out.read_expert(r["layer"], r["expert"], "w1")
        assert r["method"] == ("rtn" if r["tokens"] < threshold else "gptq")
        assert np.array_equal(stored, rtn.packed) == (r["method"] == "rtn")


def test_huge_min_tokens_sends_every_expert_to_rtn(synth_case, root, calib_file, capsys):
    dst = root / "synth.min.q"
    run("quantize", synth_case.src, dst, "--calib", calib_file, "--min-tokens", "1000000")
    assert "RTN fallback for 32 experts" in capsys.readouterr().out
    report = json.loads((dst / REPORT_FILE).read_text())
    assert report["expert_methods"] == {"rtn": 32} and len(report["fallbacks"]) == 32


def test_json_token_file(tmp_path):
    good, ragged = tmp_path / "good.json", tmp_path / "ragged.json"
    good.write_text(json.dumps([[1, 2, 3], [4, 5, 6]]))
    ragged.write_text(json.dumps([[1, 2, 3], [4, 5]]))
    np.testing.assert_array_equal(read_token_file(good, 10), [[1, 2, 3], [4, 5, 6]])
    got = read_token_sequences(ragged, 10)
    assert [q.tolist() for q in got] == [[1, 2, 3], [4, 5]] and got[0].dtype == np.int32
    with pytest.raises(ValueError, match="equal-length here, got lengths 2..3"):
        read_token_file(ragged, 10)  # held-out evaluation keeps one length
    with pytest.raises(ValueError, match=r"\[0, 5\), got 4\.\.6 in sequence 1"):
        read_token_file(good, 5)
    for text, why in [("[[1, 2], []]", "sequence 1 is empty"), ("[]", "no sequences"),
                      ('[[1, "a"]]', "sequence 0: 'a' is not a token id"),
                      ("[[1, true]]", "sequence 0: True is not a token id"),
                      ("[[1, 2]", "unreadable")]:  # fmt: skip
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=rf"token file .*bad\.json: .*{why}"):
            read_token_sequences(tmp_path / "bad.json", 10)


# ------------------------------------------ GPTQ fallback warnings, ragged calibration files

# in dims 128 (w1/w3) and 256 (w2): GPTQ by default needs 256 and 512 routed tokens
SMALL = tiny_config("mixtral", hidden_size=128, expert_intermediate_size=256, head_dim=32,
                    num_experts=4)  # fmt: skip


def _quantize_small(tmp_path, seqs, **kw):
    """Quantize a SMALL checkpoint calibrated on `seqs` (JSON file, no random sequences)."""
    src, dst, calib = tmp_path / "float", tmp_path / "q", tmp_path / "calib.json"
    if not src.exists():
        write_checkpoint(SMALL, src, seed=1)
    calib.write_text(json.dumps([list(map(int, q)) for q in seqs]))
    return quantize_checkpoint(src, dst, calib=calib, mix_random=0.0, progress=False,
                               overwrite=True, **kw)  # fmt: skip


def test_gptq_fallback_warns_with_the_experts_and_their_token_counts(tmp_path):
    seqs = np.random.default_rng(5).integers(0, SMALL.vocab_size, (25, 32))  # 800 tokens
    with pytest.warns(CalibrationWarning) as caught:
        report = _quantize_small(tmp_path, seqs)
    by_layer = {w.message.fallbacks[0][0]: w.message for w in caught}
    assert report.fallbacks and sorted(by_layer) == sorted({li for li, _, _ in report.fallbacks})
    for layer, warning in by_layer.items():
        records = [r for r in report.experts if r.layer == layer]
        assert sum(r.tokens for r in records) == SMALL.top_k * seqs.size  # each token: top-2
        fell = [r for r in records if "rtn" in r.methods]
        assert warning.fallbacks == tuple((layer, r.expert, r.tokens) for r in fell)
        text = str(warning)
        assert text.startswith(f"layer {layer}: {len(fell)} of 4 experts got fewer routed ")
        assert "(256 for w1/w3 and 512 for w2, 2 x K)" in text and "--calib" in text
        for r in fell:
            only = "" if r.method == "rtn" else ", w2 only"
            assert f"E{r.expert} ({r.tokens} tokens{only})" in text
            assert r.tokens < 256 if r.method == "rtn" else 256 <= r.tokens < 512
    assert {r.method for r in report.experts} >= {"mixed"}, "no expert between the thresholds"


def test_dense_gptq_fallback_warns_too(tmp_path):
    seqs = np.random.default_rng(6).integers(0, SMALL.vocab_size, (2, 8))
    with pytest.warns(CalibrationWarning) as caught:
        report = _quantize_small(tmp_path, seqs, dense="int8-gptq", experts="int4-rtn")
    dense = sorted(str(w.message) for w in caught)
    assert dense == sorted(
        f"layer {li} {m}: int8-gptq needs at least 256 calibration tokens (2 x K, K = 128), "
        "got 16: rounded to nearest instead; give more calibration data (--calib)"
        for li in range(SMALL.num_layers) for m in ("wq/wk/wv", "wo")
    )  # fmt: skip
    assert {m for _, _, m in report.dense} == {"rtn"}


def test_enough_calibration_warns_nothing(tmp_path):
    seqs = np.random.default_rng(7).integers(0, SMALL.vocab_size, (4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)
        report = _quantize_small(tmp_path, seqs, min_tokens=1)
    assert {r.method for r in report.experts} == {"gptq"}


RAGGED = [37, 64, 1, 64]  # lengths of the ragged calibration prompts


def _one_by_one_reference(src: Path, dst: Path, prompts: list[np.ndarray]):
    """Each layer's expert token counts and int4 GPTQ weights, from the prompts run through the
    layer one at a time (batch of one, no padding): the Hessians gather each prompt's routed
    rows; layer l + 1's inputs come from the quantized experts stored in `dst`."""
    fl, qu = CheckpointReader(src), CheckpointReader(dst)
    cfg = fl.config.replace(dtype="float32")
    embed = np.asarray(fl.read_globals()["embed"], np.float32)
    xs = [embed[q][None] for q in prompts]
    gcfg = gptq.GPTQConfig(min_tokens=1)
    slot_row = jnp.arange(cfg.num_experts, dtype=jnp.int32)
    for layer in range(cfg.num_layers):
        lp, _ = quantize.layer_params(fl, layer)
        _, pool = quantize.layer_params(qu, layer)
        floats = dict(fl.iter_layer_experts(layer))
        mids = [quantize.attention_residuals(cfg, lp, x) for x in xs]
        routed = [quantize.moe_inputs(cfg, lp, m) for m in mids]
        counts, weights = [], []
        for e in range(cfg.num_experts):
            xe = np.concatenate([h[(r == e).any(-1)] for h, r in routed])
            counts.append(len(xe))
            w1, w3 = (_gptq(floats[k][e], xe, gcfg) for k in ("w1", "w3"))
            mid = quantize.swiglu_hidden(xe, *map(quant.dequantize_int4, (w1, w3)))
            weights.append((w1, w3, _gptq(floats["w2"][e], mid, gcfg)))
        yield layer, counts, weights
        xs = [quantize.moe_outputs(cfg, lp, m, pool, slot_row) for m in mids]


def _gptq(w, x, cfg):
    acc = gptq.HessianAccumulator(x.shape[-1]).add(x) if len(x) else None
    return gptq.quantize_expert(np.asarray(w, np.float32), acc, cfg)[0]


def test_ragged_calibration_equals_the_prompts_one_by_one(tmp_path):
    rng = np.random.default_rng(8)
    prompts = [rng.integers(1, SMALL.vocab_size, n) for n in RAGGED]
    report = _quantize_small(tmp_path, prompts, dense="none", min_tokens=1)
    assert report.calib_sequences == len(RAGGED) and report.calib_tokens == sum(RAGGED)
    assert f"{len(RAGGED)} x 1..64 ({sum(RAGGED)}) tokens" in report.calibration
    stored = CheckpointReader(tmp_path / "q")
    for layer, counts, weights in _one_by_one_reference(tmp_path / "float", tmp_path / "q",
                                                        prompts):  # fmt: skip
        assert [r.tokens for r in report.experts if r.layer == layer] == counts
        for e, ws in enumerate(weights):
            for kind, w in zip(("w1", "w3", "w2"), ws, strict=True):
                np.testing.assert_array_equal(stored.read_expert(layer, e, kind), w.packed)
                np.testing.assert_array_equal(
                    stored.read_expert(layer, e, f"{kind}_scale").view(np.uint16),
                    np.asarray(w.scales).view(np.uint16))


def test_ragged_random_sequences_take_the_files_lengths(tmp_path):
    path = tmp_path / "ragged.json"
    path.write_text(json.dumps([[5] * 3, [6] * 7]))
    cal = calibration_tokens(tmp_path, str(path), SMALL, mix_random=0.6, seed=0)
    assert cal.lengths.tolist() == [3, 7, 3, 7, 3] and cal.tokens.shape == (5, 7)
    assert (cal.tokens[~cal.valid] == PAD_TOKEN).all() and cal.num_tokens == 23
    assert cal.tokens[:2][cal.valid[:2]].tolist() == [5] * 3 + [6] * 7


def test_bad_inputs_exit_2(synth_case, root, capsys):
    src, dst = str(synth_case.src), str(root / "bad.q")
    with pytest.raises(SystemExit) as e:
        cli.main(["quantize", src, dst, "--experts", "int5-gptq"])
    assert e.value.code == 2 and "invalid choice: 'int5-gptq'" in capsys.readouterr().err
    assert cli.main(["quantize", src, dst, "--calib", str(root / "missing.npy")]) == 2
    assert "calibration file" in capsys.readouterr().err
    assert cli.main(["quantize", str(synth_case.dst), dst]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert cli.main(["quantize", src, str(synth_case.dst), "--experts", "int4-rtn"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert not Path(dst).exists()
