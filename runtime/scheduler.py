"""Continuous batching over the engine's fixed rows, with a streaming submit / iterate API.

Requests join at any step: new ones are prefilled together (only their rows are live, so only
their experts are fetched) and merged into the persistent per-row KV cache; every step then
decodes all rows at the fixed batch capacity, padding free rows. A request finishes on a stop
id or its token limit and frees its row at once. A request whose expert chunk is unreadable
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


@dataclass
class Request:
    """One generation request and its progress."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    done: bool = False


class Scheduler:
    """Runs an Engine's rows as a continuous batch."""

    def __init__(self, engine) -> None:
        self.engine = engine
        cfg, config = engine.cfg, engine.config
        self.capacity, self.max_len = config.batch_capacity, config.max_len
        cache = mdl.init_cache(cfg, self.capacity, self.max_len)
        self.ks, self.vs = tuple(cache.k), tuple(cache.v)
        self.rows: list[Request | None] = [None] * self.capacity
        self.lengths = np.zeros(self.capacity, np.int32)
        self.queue: deque[Request] = deque()
        self._ids = itertools.count()

    def submit(self, prompt: list[int], max_new_tokens: int, stop_ids=()) -> Request:
        """Queue a request; it joins the batch at the next step with a free row."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("a request needs a non-empty prompt and max_new_tokens >= 1")
        if api.bucket(len(prompt)) + max_new_tokens > self.max_len:
            raise ValueError(f"prompt of {len(prompt)} + {max_new_tokens} tokens > max_len")
        req = Request(next(self._ids), list(prompt), max_new_tokens, frozenset(stop_ids))
        self.queue.append(req)
        return req

    def stream(self, req: Request) -> Iterator[int]:
        """Yield `req`'s tokens as they are produced, stepping the whole batch."""
        seen = 0
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
        while self.queue or any(r is not None for r in self.rows):
            self.step()

    def step(self) -> None:
        self._admit()
        running = np.array([r is not None for r in self.rows])
        if not running.any():
            return
        eng = self.engine
        eng._live, eng._errors = running.copy(), {}
        last = np.array([r.tokens[-1] if r else 0 for r in self.rows], np.int32)
        ks, vs = list(self.ks), list(self.vs)
        logits = eng.decode_step(last, self.lengths, ks, vs)
        self.ks, self.vs = tuple(ks), tuple(vs)
        self.lengths += running
        self._emit(np.argmax(logits, -1), running)

    def _admit(self) -> None:
        free = [i for i, r in enumerate(self.rows) if r is None]
        new = {}
        while free and self.queue:
            new[free.pop(0)] = self.queue.popleft()
        if not new:
            return
        t = api.bucket(max(len(r.prompt) for r in new.values()))
        tokens = np.zeros((self.capacity, t), np.int32)
        mask = np.zeros(self.capacity, bool)
        for i, req in new.items():
            tokens[i, : len(req.prompt)] = req.prompt
            mask[i] = True
        eng = self.engine
        eng._live, eng._errors = mask.copy(), {}
        ks, vs = list(self.ks), list(self.vs)
        logits = eng._prefill(tokens, ks, vs, mask)
        self.ks, self.vs = tuple(ks), tuple(vs)
        lengths = np.array([len(new[i].prompt) if i in new else 1 for i in range(self.capacity)])
        first = np.argmax(np.asarray(logits)[np.arange(self.capacity), lengths - 1], -1)
        for i, req in new.items():
            self.rows[i] = req
            self.lengths[i] = len(req.prompt)
        self._emit(first, mask)

    def _emit(self, tokens: np.ndarray, rows: np.ndarray) -> None:
        """Append each live row's token; finish rows on error, stop id or token limit."""
        errors = self.engine._errors
        for i in np.nonzero(rows)[0]:
            req = self.rows[i]
            if i in errors:
                req.error, req.done = errors[i], True
            else:
                req.tokens.append(int(tokens[i]))
                req.done = (len(req.tokens) >= req.max_new_tokens
                            or req.tokens[-1] in req.stop_ids)
            if req.done:
                self.rows[i] = None
                self.lengths[i] = 0
