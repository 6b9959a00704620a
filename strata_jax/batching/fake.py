"""A fake engine for tests of what drives the engine contract (the scheduler, the serving
loop): no model, no device, deterministic. A row's next token is `next_token` of the tokens
in its row (greedy; sampling settings are ignored), its logits `logits` of them, so a test
knows every request's tokens and log-probabilities without the engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from strata_jax.batching.contract import StepResult
from strata_jax.batching.packing import Admission, Prefilled, PromptScores, Ride
from strata_jax.formats.config import ModelConfig
from strata_jax.step.programs import SCORE_TOP


def next_token(sequence: Sequence[int], vocab: int) -> int:
    """The fake model's next token after `sequence`."""
    h = len(sequence)
    for t in sequence[-3:]:
        h = (h * 31 + int(t)) % 1_000_003
    return h % vocab


def logits(sequence: Sequence[int], vocab: int) -> np.ndarray:
    """float32 [vocab] logits after `sequence`: `next_token` highest, the others spread."""
    out = -((np.arange(vocab) * 7 + len(sequence)) % 13).astype(np.float32) / 4
    out[next_token(sequence, vocab)] = 2.0
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)


@dataclass
class FakeCounters:
    """What the serving loop reads of an engine's counters."""

    decode_tokens: int = 0
    prefill_tokens: int = 0


@dataclass
class FakeEngine:
    """`capacity` rows of `max_len` positions of a `cfg`-shaped model that computes nothing.
    `steps` counts dispatched decode steps; each `prefill` call is one program (the riders
    take one step in it)."""

    cfg: ModelConfig
    capacity: int
    max_len: int
    prefill_chunk: int = 64
    prefill_rows: int = 8
    steps: int = 0
    counters: FakeCounters = field(default_factory=FakeCounters)
    _rows: dict[int, list[int]] = field(default_factory=dict)
    _live: set[int] = field(default_factory=set)

    def prefill(self, admissions: Sequence[Admission], ride: Ride | None = None
                ) -> list[Prefilled]:
        riders = list(ride({}, {})) if ride is not None else []
        out = []
        for a in admissions:
            if a.start + len(a.tokens) > self.max_len:
                raise ValueError(f"row {a.row}: does not fit max_len={self.max_len}")
            row = self._rows.get(a.row, [])[: a.start] + list(a.tokens)
            token = next_token(row, self.cfg.vocab_size)
            scores = self._scores(row, a.start, token) if a.scores else None
            self._rows[a.row] = row + [token]
            self._live.add(a.row)
            self.counters.prefill_tokens += len(a.tokens)
            out.append(Prefilled(token, None, scores))
        if ride is not None:
            ride({r: self._advance(r) for r in riders if r in self._live}, {})
        return out

    def step(self) -> StepResult:
        self.steps += 1
        tokens = np.zeros(self.capacity, np.int32)
        scores = np.zeros((self.capacity, self.cfg.vocab_size), np.float32)
        for r in sorted(self._live):
            scores[r] = logits(self._rows[r], self.cfg.vocab_size)
            tokens[r] = self._advance(r)
        self.counters.decode_tokens += len(self._live)
        return StepResult(tokens, {}, scores)

    def read(self, result: StepResult) -> np.ndarray:
        return np.asarray(result.tokens)

    def free(self, row: int) -> None:
        self._live.discard(row)

    def stats(self) -> dict:
        return {}

    def reset_stats(self) -> None:
        self.counters = FakeCounters()

    def close(self) -> None:
        pass

    def _advance(self, row: int) -> int:
        """The row's next token, appended (its last token joins the KV)."""
        token = next_token(self._rows[row], self.cfg.vocab_size)
        self._rows[row].append(token)
        return token

    def _scores(self, row: list[int], start: int, drawn: int) -> PromptScores:
        """Each admitted token after the first, then the drawn one, scored given those before
        it (`packing.PromptScores`)."""
        vocab, k = self.cfg.vocab_size, min(SCORE_TOP, self.cfg.vocab_size)
        targets = row[start + 1 :] + [drawn]
        logp = np.stack([log_softmax(logits(row[: start + j + 1], vocab))
                         for j in range(len(targets))])
        top_ids = np.argsort(-logp, axis=-1, kind="stable")[:, :k].astype(np.int32)
        return PromptScores(target=logp[np.arange(len(targets)), targets],
                            top=np.take_along_axis(logp, top_ids, -1), top_ids=top_ids)
