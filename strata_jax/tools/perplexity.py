"""Perplexity on real text through the checkpoint's tokenizer (`strata eval ppl`).

The text is encoded once (with the tokenizer's special tokens, e.g. a leading bos), then cut
into windows of at most `seq_len` input tokens that start `stride` tokens apart. Token i
(i >= 1) is scored once, by the first window whose inputs end at or after token i-1: its
negative log-likelihood under the logits at position i-1, whose context is the window's
tokens before i. With stride == seq_len the windows do not overlap; a smaller stride gives
every scored token more context. Logits come from `strata_jax.logits` (the resident forward
of the one compiled step), windows batched and right-padded to one shape (causal: padding
after a position does not change its logits); the log-softmax and the sum of the NLL are
float64.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from strata_jax import api
from strata_jax.batching.checks import check_tokens
from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.formats.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True, kw_only=True)
class Window:
    """Inputs tokens[begin:end]; scores the targets first..end (inclusive)."""

    begin: int
    """First input token."""
    end: int
    """One past the last input token; the last target is token `end`."""
    first: int
    """First target this window scores (earlier ones were scored by earlier windows)."""


def windows(n: int, seq_len: int, stride: int | None = None) -> list[Window]:
    """The windows over `n` tokens (module doc); every token 1..n-1 is scored exactly once."""
    stride = seq_len if stride is None else stride
    if n < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {n}")
    if seq_len < 1 or not 1 <= stride <= seq_len:
        raise ValueError(f"need seq_len >= 1 and 1 <= stride <= seq_len, got seq_len={seq_len}, "
                         f"stride={stride}")
    out, done, begin = [], 1, 0
    while done < n:
        end = min(begin + seq_len, n - 1)
        out.append(Window(begin=begin, end=end, first=done))
        done, begin = end + 1, begin + stride
    return out


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """float64 -log softmax(logits)[target] per row of logits [T, V]."""
    z = np.asarray(logits, np.float64)
    top = z.max(axis=-1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(z - top).sum(axis=-1))
    return lse - z[np.arange(len(z)), targets]


@dataclass(frozen=True, kw_only=True)
class Perplexity:
    """One checkpoint's perplexity on one text."""

    checkpoint: str
    """The checkpoint folder."""
    quantization: dict[str, str] = field(default_factory=dict)
    """Its config.json quantization (dense, experts)."""
    tokens: int
    """Tokens of the encoded text."""
    scored: int
    """Tokens scored (all but the first)."""
    windows: int
    """Forward windows run."""
    seq_len: int
    """Most input tokens per window."""
    stride: int
    """Tokens between window starts."""
    nll_sum: float
    """Sum of the scored tokens' negative log-likelihoods (nats, float64)."""

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood per scored token (nats)."""
        return self.nll_sum / self.scored

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "nll": self.nll, "ppl": self.ppl}


def perplexity(model: api.Model, tokens: list[int], *, seq_len: int = 256,
               stride: int | None = None, batch: int = 8, checkpoint: str = "",
               quantization: dict[str, str] | None = None) -> Perplexity:
    """`model`'s perplexity on `tokens` (module doc); `batch` windows per forward."""
    ids = np.asarray(tokens, np.int32)
    check_tokens(model.config, ids, "the text's tokens")
    spans = windows(len(ids), seq_len, stride)
    width = max(w.end - w.begin for w in spans)  # one shape for every forward
    total = 0.0
    for first in range(0, len(spans), batch):
        group = spans[first : first + batch]
        inputs = np.zeros((batch, width), np.int32)
        for row, w in enumerate(group):
            inputs[row, : w.end - w.begin] = ids[w.begin : w.end]
        logits = api.logits(model, inputs)
        for row, w in enumerate(group):
            positions = np.arange(w.first - 1, w.end) - w.begin
            total += float(token_nll(logits[row, positions], ids[w.first : w.end + 1]).sum())
    return Perplexity(checkpoint=checkpoint, quantization=dict(quantization or {}),
                      tokens=len(ids), scored=len(ids) - 1, windows=len(spans), seq_len=seq_len,
                      stride=seq_len if stride is None else stride, nll_sum=total)


@dataclass(frozen=True, kw_only=True)
class PerplexityReport:
    """`strata eval ppl`: the checkpoint, and its float reference if one was given."""

    text: str
    """The text file."""
    results: tuple[Perplexity, ...]
    """The checkpoint's, then the reference's."""

    def table(self) -> str:
        r0 = self.results[0]
        lines = [f"{self.text}: {r0.tokens} tokens, {r0.scored} scored in {r0.windows} windows "
                 f"of <= {r0.seq_len} (stride {r0.stride})",
                 f"  {'checkpoint':<40} {'dense/experts':<16} {'ppl':>10} {'nll/token':>10}"]
        for r in self.results:
            quant = f"{r.quantization.get('dense', '?')}/{r.quantization.get('experts', '?')}"
            lines.append(f"  {_short(r.checkpoint):<40} {quant:<16} {r.ppl:>10.4f} "
                         f"{r.nll:>10.5f}")
        if len(self.results) == 2:
            lines.append(f"  ppl ratio (checkpoint / reference): "
                         f"{self.results[0].ppl / self.results[1].ppl:.5f}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        return {"text": self.text, "results": [r.to_dict() for r in self.results]}


def _short(path: str, width: int = 40) -> str:
    return path if len(path) <= width else "..." + path[-(width - 3):]


def read_text(path: str | os.PathLike) -> str:
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"--text {p}: no such file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {p}: not UTF-8 text ({e.reason} at byte {e.start})") from e


def _same_tokenizer(tok: Tokenizer, ref: str | os.PathLike, text: str) -> None:
    """The reference must read the text as the same ids (if it has a tokenizer at all)."""
    if not (Path(ref) / "tokenizer.json").is_file():
        return
    if load_tokenizer(ref).encode(text) != tok.encode(text):
        raise ValueError(f"--ref {ref}: its tokenizer encodes the text differently from "
                         f"{tok.source}'s; compare checkpoints of one model")


def evaluate_perplexity(ckpt: str | os.PathLike, text_file: str | os.PathLike, *,
                        ref: str | os.PathLike | None = None, seq_len: int = 256,
                        stride: int | None = None, batch: int = 8) -> PerplexityReport:
    """Perplexity of `ckpt` (and of `ref`, e.g. its float source) on the text of `text_file`,
    encoded by `ckpt`'s tokenizer; one model is resident at a time."""
    text = read_text(text_file)
    tok = load_tokenizer(ckpt)
    ids = tok.encode(text)
    if ref is not None:
        _same_tokenizer(tok, ref, text)
    results = []
    for path in (ckpt, *(() if ref is None else (ref,))):
        reader = CheckpointReader(path)
        model = api.load(path)
        results.append(perplexity(model, ids, seq_len=seq_len, stride=stride, batch=batch,
                                  checkpoint=str(reader.path),
                                  quantization=reader.quantization))
        del model
    return PerplexityReport(text=str(text_file), results=tuple(results))


def write_json(report: PerplexityReport, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
