"""A resident model's rows behind the engine contract (prefill / step / read / free over
integer rows), so `strata_jax.generate` runs the scheduler's one generation loop, as the
offload engine does (docs/design.md, "One generation loop"). Every expert has a slot: no
tiers, no records to observe."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strata_jax import step
from strata_jax.sampling import GREEDY, SamplingParams, row_values
from strata_jax.scheduler import StepResult

if TYPE_CHECKING:
    from strata_jax.api import Model


class ResidentEngine:
    """`capacity` rows of `max_len` positions of a resident `Model`'s decode state, prompts
    prefilled in chunks of `prefill_chunk` tokens (None: `step.default_prefill_chunk`)."""

    def __init__(self, model: Model, capacity: int, max_len: int,
                 prefill_chunk: int | None = None) -> None:
        self.cfg, self.capacity, self.max_len = model.config, capacity, max_len
        self.prefill_chunk = step.check_prefill_chunk(
            prefill_chunk or step.default_prefill_chunk(max_len))
        self._decode, self._prefill, _, tiers = model.programs()
        self._args = (model.params, model.experts, tiers)
        self.state = model.init_state(capacity, max_len)
        self._greedy = [True] * capacity  # per row: may decode with the plain argmax
        self._live = [False] * capacity

    def prefill(self, row: int, tokens: list[int], start: int = 0,
                sampling: SamplingParams = GREEDY,
                request: int | None = None) -> tuple[int, None]:
        """Write `tokens` into row `row`'s KV from position `start`, chunked as on every path
        (`step.prefill_chunks`), and make it live; returns (its next token, None)."""
        prompt = np.asarray(tokens, np.int32)
        values = row_values(sampling)
        out = None
        for first, size, count in step.prefill_chunks(len(prompt), self.prefill_chunk):
            chunk = np.zeros(size, np.int32)
            chunk[:count] = prompt[first : first + count]
            self.state, out, _ = self._prefill(self.cfg, step.StepPlan(), *self._args,
                                               self.state, row, chunk, start + first, count,
                                               values)
        self._greedy[row], self._live[row] = sampling.greedy, True
        return int(out.tokens), None

    def step(self) -> StepResult:
        """Dispatch one token for every live row (the sampler's program only when a live row
        samples: both give a greedy row the same bits)."""
        sampled = any(not g for g, on in zip(self._greedy, self._live, strict=True) if on)
        self.state, out, _ = self._decode(self.cfg, step.StepPlan(sample=sampled),
                                          *self._args, self.state)
        return StepResult(out.tokens, {}, out.logits)

    def read(self, result: StepResult) -> np.ndarray:
        return np.asarray(result.tokens)

    def free(self, row: int) -> None:
        self.state = step.set_live(self.state, row, False)
        self._live[row] = False
