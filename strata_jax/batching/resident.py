"""A resident model's rows behind the engine contract (prefill / step / read / free over
integer rows), so `strata_jax.generate` runs the scheduler's one generation loop, as the
offload engine does (docs/design.md, "One generation loop"). Every expert has a slot: no
tiers, no records to observe."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from strata_jax.batching import packing
from strata_jax.batching.contract import StepResult
from strata_jax.batching.packing import Admission
from strata_jax.step import programs as step

if TYPE_CHECKING:
    from strata_jax.step.loaded import Model


class ResidentEngine:
    """`capacity` rows of `max_len` positions of a resident `Model`'s decode state, prompts
    prefilled in chunks of `prefill_chunk` tokens (None: `step.default_prefill_chunk`), up to
    `prefill_rows` prompts' chunks a program (None: `capacity`; `packing.pack`)."""

    def __init__(self, model: Model, capacity: int, max_len: int,
                 prefill_chunk: int | None = None, prefill_rows: int | None = None) -> None:
        self.cfg, self.capacity, self.max_len = model.config, capacity, max_len
        self.prefill_chunk = step.check_prefill_chunk(
            prefill_chunk or step.default_prefill_chunk(max_len))
        self.prefill_rows = prefill_rows or capacity
        self._decode, self._prefill, _, tiers = model.programs()
        self._args = (model.params, model.experts, tiers)
        self.state = model.init_state(capacity, max_len)
        self._greedy = [True] * capacity  # per row: may decode with the plain argmax
        self._live = [False] * capacity

    def prefill(self, admissions: Sequence[Admission], ride: packing.Ride | None = None
                ) -> list[packing.Prefilled]:
        """Write each admission's tokens into its row's KV from its start, packed and chunked
        as on every path (`packing.run`), with the decode steps of `ride` riding along, and
        make the rows live; returns each row's `packing.Prefilled`."""

        def call(args: packing.ProgramArgs) -> packing.ProgramOut:
            self.state, out, _ = self._prefill(self.cfg, step.StepPlan(), *self._args,
                                               self.state, *args)
            return (np.asarray(out.tokens), np.asarray(out.riders), {},
                    packing.host_scores(out.scores))

        results = packing.run(admissions, self.prefill_chunk, self.prefill_rows,
                              self.capacity, call, ride)
        for a in admissions:
            self._greedy[a.row], self._live[a.row] = a.sampling.greedy, True
        return results

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
