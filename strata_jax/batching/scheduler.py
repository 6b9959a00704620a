"""Continuous batching over the engine's rows, through its public contract only.

Requests join at any step: the queued requests take free rows, are prefilled into them
together (`Engine.prefill`), and from then on every `Engine.step` decodes one token for it,
whatever else shares the batch. A request finishes on a stop id, a stop string (with a
tokenizer: its text is followed by a `text.TextStream`) or its token limit and its row is
freed (`Engine.free`), unless it was submitted with `keep=True`: then it stays idle in its row with
its KV, and `resume` prefills only the new input after it. When a request waits and no row is
free, the least recently active idle request is evicted (its KV dropped, its tokens kept); a
later `resume` prefills its whole sequence again. A request whose expert chunk is unreadable
fails alone.

The host reads step n's tokens after it has dispatched step n + 1 (docs/design.md, "One
generation loop"), so the device never waits on the host between steps. A row whose token
limit ends the request is not stepped again; a row that stops on a stop id is stepped once
more, and that token is dropped (its KV write lands where a resumed turn writes anyway).
While requests are prefilled, the running rows ride along: each prefill program also takes
their decode step (docs/design.md, "Prefill"), so they do not wait for the prompts. A request
submitted with `logprobs` gets each generated token's log-probability (`Request.token_scores`):
its first from its scored prefill, the others from a small program over the decode step's
logits (`step.score_drawn`), dispatched only for steps where such a request runs; such a row
does not ride (a prefill program gives no riders' logits).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strata_jax.batching.checks import check_request
from strata_jax.batching.contract import EngineContract, StepResult
from strata_jax.batching.packing import Admission, PromptScores, TokenScore, host_scores
from strata_jax.batching.text import CONTEXT_IDS, Decoder, TextStream
from strata_jax.step import programs as step_programs
from strata_jax.step.sampling import GREEDY, SamplingParams


@dataclass(eq=False)
class Request:
    """One generation request (or a multi-turn session with `keep`) and its progress."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY  # its seed fixed at submission
    keep: bool = False
    tokens: list[int] = field(default_factory=list)  # generated, every turn
    error: str | None = None
    done: bool = False
    cancelled: bool = False
    sequence: list[int] = field(default_factory=list)  # prompt, generated and resumed input
    budget: int = 0  # tokens still to generate this turn
    last_active: int = 0
    evicted: bool = False
    text: TextStream | None = None  # this turn's text, where stop strings end it
    score_prompt: bool = False  # score the prompt's tokens (`scores`)
    scores: PromptScores | None = None  # the prompt's log-probabilities, with `score_prompt`
    logprobs: bool = False  # score each generated token (`token_scores`)
    token_scores: list[TokenScore] = field(default_factory=list)  # one per token, `logprobs`


class Scheduler:
    """Runs an engine's rows (`contract.EngineContract`) as a continuous batch. `tokenizer`:
    what stop strings are matched through (requests with stop strings need one)."""

    def __init__(self, engine: EngineContract, tokenizer: Decoder | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.capacity, self.max_len = engine.capacity, engine.max_len
        self.rows: list[Request | None] = [None] * self.capacity
        self.kv_len = [0] * self.capacity  # tokens in each row's KV
        self.queue: deque[Request] = deque()
        self.steps = 0
        self.evictions = 0
        self._ids = itertools.count()
        self._turn = [0] * self.capacity  # prefills into each row: tells a stale token apart
        self._flight: tuple[StepResult, list[tuple[int, Request, int]], Any] | None = None

    def submit(self, prompt: list[int], max_new_tokens: int,
               sampling: SamplingParams = GREEDY, keep: bool = False,
               score_prompt: bool = False, logprobs: bool = False) -> Request:
        """Queue a request; it joins the batch at the next step with a free row. A seed of
        None in `sampling` is drawn now, so an evicted request resumes the same draws.
        `score_prompt`: its prompt's log-probabilities (`Request.scores`) come with its first
        token; `logprobs`: each generated token's (`Request.token_scores`)."""
        rid = next(self._ids)
        check_request(self.engine.cfg, rid, prompt, max_new_tokens, self.max_len)
        sampling = dataclasses.replace(sampling, seed=sampling.resolved_seed())
        req = Request(rid, list(prompt), max_new_tokens, sampling, keep,
                      sequence=list(prompt), budget=max_new_tokens, score_prompt=score_prompt,
                      logprobs=logprobs)
        req.text = self._text(req)
        self.queue.append(req)
        return req

    def _text(self, req: Request) -> TextStream | None:
        """A new turn's text stream where stop strings can end it."""
        if not req.sampling.stop:
            return None
        if self.tokenizer is None:
            raise ValueError(f"request {req.id}: stop strings {list(req.sampling.stop)} need a "
                             "tokenizer to match the text")
        return TextStream(self.tokenizer, req.sampling.stop,
                          context=req.sequence[-CONTEXT_IDS:])

    def resume(self, req: Request, tokens: list[int], max_new_tokens: int) -> Request:
        """Continue a finished `keep` request with more input (e.g. the next chat turn)."""
        if not (req.keep and req.done) or req.error:
            raise ValueError(f"request {req.id} is not an idle kept request")
        check_request(self.engine.cfg, req.id, req.sequence + list(tokens), max_new_tokens,
                      self.max_len)
        req.sequence += tokens
        req.done, req.budget, req.last_active = False, max_new_tokens, self.steps
        req.text = self._text(req)
        if req.evicted:
            req.evicted = False
        self.queue.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """End `req` now (a client went away): its row is freed and nothing more is generated;
        `req.cancelled` says so. A finished request is left as it is."""
        self._collect()  # the tokens already computed are the request's
        if req.done and not (req.keep and self._row_of(req) is not None):
            return
        if req in self.queue:
            self.queue.remove(req)
        row = self._row_of(req)
        if row is not None:
            if not req.done:
                self.engine.free(row)
            self.rows[row] = None
        req.done, req.cancelled, req.keep = True, True, False

    def stream(self, req: Request) -> Iterator[int]:
        """Yield `req`'s tokens as they are produced, stepping the whole batch."""
        seen = len(req.tokens)
        while True:
            while seen < len(req.tokens):
                yield req.tokens[seen]
                seen += 1
            if req.done:
                if req.error:
                    raise RuntimeError(f"request {req.id} failed: {req.error}")
                return
            self.step()

    def run(self) -> None:
        """Step until every submitted request is finished."""
        while (self.queue or self._flight is not None
               or any(r is not None and not r.done for r in self.rows)):
            self.step()

    def step(self) -> None:
        """Admit queued requests (the running rows riding along their prefill, the step in
        flight taken first), dispatch a decode step of the running rows, then take the
        previous step's tokens."""
        self.steps += 1
        if self.queue and self._flight is not None:
            self._collect()  # the riders' next inputs: the step in flight's tokens
        self._admit()
        ahead = {i for i, _, _ in self._flight[1]} if self._flight else set()
        running = [i for i, r in enumerate(self.rows)
                   if r is not None and not r.done and r.budget > (i in ahead)]
        dispatched = None
        if running:
            result = self.engine.step()
            scored = None
            if any(self.rows[i].logprobs for i in running):
                scored = step_programs.score_drawn(result.logits, result.tokens)
            dispatched = (result, [(i, self.rows[i], self._turn[i]) for i in running], scored)
        self._collect()
        self._flight = dispatched

    def _collect(self) -> None:
        """Take the tokens of the step in flight: rows still running the same turn emit."""
        if self._flight is None:
            return
        result, rows, scored = self._flight
        self._flight = None
        tokens = np.asarray(self.engine.read(result))
        scored = host_scores(scored)
        for i, req, turn in rows:
            if self.rows[i] is not req or req.done or self._turn[i] != turn:
                continue  # finished, cancelled or prefilled again since the dispatch
            self.kv_len[i] += 1
            if i in result.failed:
                self._fail(i, result.failed[i])
            else:
                score = None
                if req.logprobs:
                    score = TokenScore(logprob=float(scored[0][i]), top=scored[1][i],
                                       top_ids=scored[2][i])
                self._emit(i, int(tokens[i]), score)

    def _admit(self) -> None:
        """Prefill queued requests into rows, all of them in one engine call (its programs
        pack their chunks: `packing`): their own row if they kept one, else a free row
        (evicting the least recently active idle request if need be)."""
        admitted: list[tuple[int, Request]] = []
        while self.queue:
            req = self.queue[0]
            row = self._row_of(req)
            if row is None:
                row = self._free_row()
                if row is None:
                    break
                self.rows[row], self.kv_len[row] = req, 0
            self.queue.popleft()
            self._turn[row] += 1
            admitted.append((row, req))
        if not admitted:
            return
        whole = {row: req.score_prompt and self.kv_len[row] == 0 for row, req in admitted}
        admissions = [Admission(row, req.sequence[self.kv_len[row]:], self.kv_len[row],
                                req.sampling, req.id, scores=whole[row] or req.logprobs)
                      for row, req in admitted]
        admitting = {row for row, _ in admitted}
        results = self.engine.prefill(admissions, lambda tokens, failed: self._ride(
            tokens, failed, admitting))
        for (row, req), done in zip(admitted, results, strict=True):
            self.kv_len[row] = len(req.sequence)
            if done.error is not None:
                self._fail(row, done.error)
                continue
            if whole[row]:
                req.scores = done.scores
            self._emit(row, done.token, done.scores.at(-1) if req.logprobs else None)

    def _ride(self, tokens: dict[int, int], failed: dict[int, str], admitting: set[int]
              ) -> list[int]:
        """Take the riders' tokens of a prefill program; the rows that ride the next: every
        running row not being admitted, unless it scores its tokens (`packing.Ride`)."""
        for row, error in failed.items():
            self.kv_len[row] += 1
            self._fail(row, error)
        for row, token in tokens.items():
            self.kv_len[row] += 1
            self._emit(row, token)
        return [i for i, r in enumerate(self.rows)
                if r is not None and not r.done and i not in admitting and not r.logprobs]

    def _row_of(self, req: Request) -> int | None:
        return next((i for i, r in enumerate(self.rows) if r is req), None)

    def _free_row(self) -> int | None:
        free = [i for i, r in enumerate(self.rows) if r is None]
        if free:
            return free[0]
        idle = [(r.last_active, i) for i, r in enumerate(self.rows)
                if r is not None and r.done and r not in self.queue]
        if not idle:
            return None
        _, i = min(idle)
        self.rows[i].evicted = True
        self.rows[i] = None
        self.evictions += 1
        return i

    def _emit(self, row: int, token: int, score: TokenScore | None = None) -> None:
        """Append a row's token (and, with `logprobs`, its score); finish it on a stop id, a
        stop string or its token limit."""
        req = self.rows[row]
        req.last_active = self.steps
        req.tokens.append(token)
        if req.logprobs:
            req.token_scores.append(score)
        req.sequence.append(token)
        req.budget -= 1
        if req.text is not None:
            req.text.push(token)
        stopped = req.text is not None and req.text.finished
        req.done = req.budget == 0 or token in req.sampling.stop_ids or stopped
        if req.done:
            self.engine.free(row)
            self.kv_len[row] = len(req.sequence) - 1  # the last token is not in the KV yet
            if not req.keep:
                self.rows[row] = None

    def _fail(self, row: int, error: str) -> None:
        req = self.rows[row]
        req.error, req.done, req.keep = error, True, False
        self.engine.free(row)
        self.rows[row] = None
