"""`strata eval ppl`: the windows, the float64 NLL against numpy, a converted tiny HF model
against transformers' own loss, and float vs quantized through the CLI."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import scipy.special

import strata_jax
from strata_jax.formats.tokenizer import (
    TOKENIZER_FILES,
    byte_level_files,
    byte_level_tokenizer,
    load_tokenizer,
)
from strata_jax.tools.perplexity import evaluate_perplexity, perplexity, windows
from strata_jax.tools.quantize import quantize_checkpoint
from strata_runtime.cli.main import main
from tests.helpers import random_model, tiny_config, write_checkpoint
from tests.text_helpers import TEXT, TEXT_FILE, write_bpe_tokenizer

HF_PPL_REL = 1e-6  # float32 logits on both sides (eager experts); measured 4e-8


@pytest.mark.parametrize(("n", "seq_len", "stride"), [
    (2, 4, None), (10, 4, None), (11, 4, 1), (100, 16, 5), (64, 64, None), (65, 8, 8),
])  # fmt: skip
def test_windows_score_every_token_once(n, seq_len, stride):
    scored = []
    for w in windows(n, seq_len, stride):
        assert 0 < w.end - w.begin <= seq_len and w.begin < w.first <= w.end + 1
        scored += range(w.first, w.end + 1)  # target i is predicted at position i - 1
    assert scored == list(range(1, n))


def test_windows_refuse_bad_shapes():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        windows(1, 8)
    with pytest.raises(ValueError, match="stride <= seq_len"):
        windows(10, 8, 9)


def test_perplexity_equals_float64_numpy_from_the_logits():
    """Batched, right-padded windows against one unpadded forward per chunk and scipy."""
    model = random_model(tiny_config(vocab_size=300), seed=3)
    ids = byte_level_tokenizer(300).encode(TEXT).ids[:641]  # 10 full windows: two shapes
    got = perplexity(model, ids, seq_len=64, batch=4)
    nll, count = 0.0, 0
    for begin in range(0, len(ids) - 1, 64):
        end = min(begin + 64, len(ids) - 1)
        logits = strata_jax.logits(model, [ids[begin:end]])[0].astype(np.float64)
        logp = scipy.special.log_softmax(logits, axis=-1)
        nll -= logp[np.arange(end - begin), ids[begin + 1 : end + 1]].sum()
        count += end - begin
    assert (got.scored, got.windows) == (count, math.ceil(count / 64)) == (len(ids) - 1, 10)
    assert got.nll_sum == pytest.approx(nll, rel=1e-6)
    assert 1 < got.ppl == pytest.approx(math.exp(nll / count), rel=1e-6)


@pytest.fixture(scope="module")
def hf_case(tmp_path_factory):
    """A tiny HF Mixtral saved with a trained BPE tokenizer, and its conversion."""
    torch = pytest.importorskip("torch")
    from tests.tools.test_hf_convert import build_model

    root = tmp_path_factory.mktemp("ppl_hf")
    src, dst = root / "hf", root / "strata"
    tok = write_bpe_tokenizer(src, vocab_size=400)
    model = build_model("mixtral", vocab_size=len(tok))
    model.save_pretrained(src)
    assert main(["convert", "hf", str(src), str(dst)]) == 0
    return torch, model, tok, src, dst


def test_convert_keeps_the_tokenizer(hf_case):
    _, _, tok, src, dst = hf_case
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert (dst / "tokenizer.json").exists() and (dst / "chat_template.jinja").exists()
    assert load_tokenizer(dst).encode(TEXT) == tok(TEXT)["input_ids"]


def test_perplexity_matches_transformers_loss(hf_case):
    """exp of transformers' mean loss over the same windows (labels -100 where a window
    does not score)."""
    torch, model, tok, _, dst = hf_case
    ids = tok(TEXT)["input_ids"]
    seq_len, stride = 64, 48
    total = 0.0
    with torch.no_grad():
        for w in windows(len(ids), seq_len, stride):
            inputs = torch.tensor([ids[w.begin : w.end + 1]])
            labels = inputs.clone()
            labels[0, : w.first - w.begin] = -100
            total += float(model(inputs, labels=labels).loss) * (w.end + 1 - w.first)
    report = evaluate_perplexity(dst, TEXT_FILE, seq_len=seq_len, stride=stride)
    (got,) = report.results
    assert got.scored == len(ids) - 1 and got.windows > len(ids) // stride - 1
    assert got.ppl == pytest.approx(math.exp(total / got.scored), rel=HF_PPL_REL)


def test_source_without_tokenizer_converts_and_says_so(hf_case, tmp_path, capsys):
    _, _, _, src, _ = hf_case
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, bare / name)
    dst = tmp_path / "bare.strata"
    assert main(["convert", "hf", str(bare), str(dst)]) == 0
    with pytest.raises(FileNotFoundError, match=f"{dst} has no tokenizer.json"):
        load_tokenizer(dst)
    capsys.readouterr()
    assert main(["eval", "ppl", str(dst), "--text", str(TEXT_FILE)]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer.json" in err and "strata convert hf" in err


def test_cli_float_and_quantized_side_by_side(tmp_path, capsys):
    float_ckpt, q_ckpt = tmp_path / "float", tmp_path / "int4"
    cfg = tiny_config(vocab_size=300, hidden_size=128, expert_intermediate_size=128,
                      head_dim=32, num_experts=4)  # int4 groups of 128 inputs
    write_checkpoint(cfg, float_ckpt, seed=1)
    for name, data in byte_level_files(cfg.vocab_size).items():
        (float_ckpt / name).write_bytes(data)
    quantize_checkpoint(float_ckpt, q_ckpt, experts="int4-rtn", dense="int8", progress=False)
    assert (q_ckpt / "tokenizer.json").read_bytes() == (float_ckpt / "tokenizer.json").read_bytes()
    text = tmp_path / "text.txt"
    text.write_text(TEXT[:1200])
    out = tmp_path / "ppl.json"
    args = ["eval", "ppl", str(q_ckpt), "--ref", str(float_ckpt), "--text", str(text),
            "--seq-len", "128", "--batch", "16", "--json", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "none/int4-g128" not in table and "int8/int4-g128" in table and "none/none" in table
    assert "ppl ratio" in table
    q, f = json.loads(out.read_text())["results"]
    assert q["quantization"]["experts"] == "int4-g128" and f["quantization"]["experts"] == "none"
    assert q["scored"] == f["scored"] == len(load_tokenizer(q_ckpt).encode(TEXT[:1200])) - 1
    assert 1 < f["ppl"] and q["ppl"] != f["ppl"]  # int4 changes the logits, not the text
    assert q["ppl"] == pytest.approx(f["ppl"], rel=0.2)
