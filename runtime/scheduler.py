"""Continuous batching over the engine's fixed rows, with a streaming submit / iterate API.

Requests join at any step: new ones are prefilled together (only their rows are live, so only
their experts are fetched) and merged into the persistent per-row KV cache; every step then
decodes all rows at the fixed batch capacity, padding free rows. A request finishes on a stop
id or its token limit and frees its row at once, unless it was submitted with `keep=True`: then
it stays idle in its row with its KV, and `resume` continues it (its new input is fed through
the ordinary decode steps, one token per step, so nothing compiles). When a request waits for a
row and none is free, the oldest idle request is evicted (its KV is dropped, its tokens kept);
resuming it later prefills its whole sequence again. A request whose expert chunk is unreadable
fails alone.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from strata_jax import api
from strata_jax import model as mdl


@dataclass(eq=False)
class Request:
    """One generation request (or a multi-turn session with `keep`) and its progress."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    keep: bool = False
    tokens: list[int] = field(default_factory=list)  # generated, every turn
    error: str | None = None
    done: bool = False
    sequence: list[int] = field(default_factory=list)  # prompt, generated and resumed input
    pending: list[int] = field(default_factory=list)  # tokens still to feed through decode
    budget: int = 0  # tokens still to generate this turn
    last_active: int = 0
    evicted: bool = False


class Scheduler:
    """Runs an Engine's rows as a continuous batch."""

    def __init__(self, engine) -> None:
        self.engine = engine
        cfg, config = engine.cfg, engine.config
        self.capacity, self.max_len = config.batch_capacity, config.max_len
        cache = mdl.init_cache(cfg, self.capacity, self.max_len)
        self.ks, self.vs = tuple(cache.k), tuple(cache.v)
        self.rows: list[Request | None] = [None] * self.capacity
        self.lengths = np.zeros(self.capacity, np.int32)  # tokens in each row's KV
        self.queue: deque[Request] = deque()
        self.steps = 0
        self.evictions = 0
        self._ids = itertools.count()

    def submit(self, prompt: list[int], max_new_tokens: int, stop_ids=(),
               keep: bool = False) -> Request:
        """Queue a request; it joins the batch at the next step with a free row. With `keep`,
        it holds its row and KV when done, until `resume`d or evicted."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("a request needs a non-empty prompt and max_new_tokens >= 1")
        self._check_room(len(prompt), max_new_tokens, "prompt")
        req = Request(next(self._ids), list(prompt), max_new_tokens, frozenset(stop_ids), keep,
                      sequence=list(prompt), budget=max_new_tokens)
        self.queue.append(req)
        return req

    def resume(self, req: Request, tokens: list[int], max_new_tokens: int) -> Request:
        """Continue a finished `keep` request with more input (e.g. the next chat turn)."""
        if not (req.keep and req.done) or req.error:
            raise ValueError(f"request {req.id} is not an idle kept request")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self._check_room(len(req.sequence) + len(tokens), max_new_tokens, f"request {req.id}")
        req.sequence += tokens
        req.done, req.budget, req.last_active = False, max_new_tokens, self.steps
        if req.evicted:  # its KV is gone: prefill the whole sequence again
            req.evicted = False
            self.queue.append(req)
        else:  # the last generated token and the new input go through decode steps
            row = next(i for i, r in enumerate(self.rows) if r is req)
            req.pending = req.sequence[self.lengths[row]:]
        return req

    def _check_room(self, length: int, new: int, what: str) -> None:
        if api.bucket(length) + new > self.max_len:
            raise ValueError(f"{what} of {length} + {new} tokens > max_len {self.max_len}")

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
        while self.queue or any(r is not None and not r.done for r in self.rows):
            self.step()

    def step(self) -> None:
        self.steps += 1
        self._admit()
        running = np.array([r is not None and not r.done for r in self.rows])
        if not running.any():
            return
        eng = self.engine
        eng._live, eng._errors = running.copy(), {}
        feed = np.zeros(self.capacity, np.int32)
        for i in np.nonzero(running)[0]:
            feed[i] = self.rows[i].pending.pop(0)
        ks, vs = list(self.ks), list(self.vs)
        logits = eng.decode_step(feed, self.lengths, ks, vs)
        self.ks, self.vs = tuple(ks), tuple(vs)
        self.lengths += running
        ready = running & np.array([r is not None and not r.pending for r in self.rows])
        self._emit(np.argmax(logits, -1), ready, running)

    def _admit(self) -> None:
        """Prefill queued requests into free rows, evicting the oldest idle ones if needed."""
        new: dict[int, Request] = {}
        while self.queue and (row := self._free_row(new)) is not None:
            new[row] = self.queue.popleft()
        if not new:
            return
        t = api.bucket(max(len(r.sequence) for r in new.values()))
        tokens = np.zeros((self.capacity, t), np.int32)
        mask = np.zeros(self.capacity, bool)
        for i, req in new.items():
            tokens[i, : len(req.sequence)] = req.sequence
            mask[i] = True
        eng = self.engine
        eng._live, eng._errors = mask.copy(), {}
        ks, vs = list(self.ks), list(self.vs)
        logits = eng._prefill(tokens, ks, vs, mask)
        self.ks, self.vs = tuple(ks), tuple(vs)
        lengths = np.array([len(new[i].sequence) if i in new else 1
                            for i in range(self.capacity)])
        first = np.argmax(np.asarray(logits)[np.arange(self.capacity), lengths - 1], -1)
        for i, req in new.items():
            self.rows[i] = req
            self.lengths[i] = len(req.sequence)
            req.pending = []
        self._emit(first, mask, mask)

    def _free_row(self, taken: dict[int, Request]) -> int | None:
        """A free row not in `taken`, freeing the least recently active idle request's row if
        needed; None if every row is busy."""
        free = [i for i, r in enumerate(self.rows) if r is None and i not in taken]
        if free:
            return free[0]
        idle = [(r.last_active, i) for i, r in enumerate(self.rows) if r is not None and r.done]
        if not idle:
            return None
        _, i = min(idle)
        self.rows[i].evicted = True
        self.rows[i], self.lengths[i] = None, 0
        self.evictions += 1
        return i

    def _emit(self, tokens: np.ndarray, ready: np.ndarray, active: np.ndarray) -> None:
        """Append each ready row's token; finish rows on error, stop id or token limit."""
        errors = self.engine._errors
        for i in np.nonzero(active)[0]:
            req = self.rows[i]
            req.last_active = self.steps
            if i in errors:
                req.error, req.done, req.keep = errors[i], True, False
            elif ready[i]:
                t = int(tokens[i])
                req.tokens.append(t)
                req.sequence.append(t)
                req.budget -= 1
                req.done = req.budget == 0 or t in req.stop_ids
                req.pending = [] if req.done else [t]
            if req.done and not req.keep:
                self.rows[i], self.lengths[i] = None, 0
