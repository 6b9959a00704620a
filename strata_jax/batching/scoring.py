"""Scoring text under the model: the log-likelihood of a continuation given its context.

What evaluation harnesses ask of a model besides generation (lm-eval's `loglikelihood`): the
context and continuation run as one prompt through the scheduler with `score_prompt`, so the
prefill programs that write its KV also give each token's log-probability given those before
it (`step.Scores`, the model's own softmax in float32), on whatever engine the scheduler drives:
the resident API and the offload engine give the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Likelihood:
    """A continuation's score given its context."""

    logprob: float
    """The sum of its tokens' natural-log probabilities (in float64)."""
    greedy: bool
    """Every token of it is the most likely one given what precedes it."""
    token_logprobs: list[float]
    """Each of its tokens' log-probability."""


def loglikelihood(sched, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
                  ) -> list[Likelihood]:
    """Score each (context ids, continuation ids) pair through `sched` (a `Scheduler`), all
    of them in its continuous batch. A context needs at least one token (lm-eval passes an
    end-of-text id where it has none)."""
    reqs = []
    for i, (context, continuation) in enumerate(pairs):
        if not len(context) or not len(continuation):
            raise ValueError(f"pair {i}: the context and the continuation each need a token")
        reqs.append(sched.submit([int(t) for t in context] + [int(t) for t in continuation],
                                 1, score_prompt=True))
    sched.run()
    out = []
    for (context, continuation), req in zip(pairs, reqs, strict=True):
        if req.error is not None:
            raise RuntimeError(f"request {req.id}: {req.error}")
        at = slice(len(context) - 1, len(context) - 1 + len(continuation))
        lp = req.scores.target[at]
        greedy = bool(np.all(req.scores.top_ids[at, 0] == np.asarray(continuation)))
        out.append(Likelihood(float(lp.astype(np.float64).sum()), greedy,
                              [float(x) for x in lp]))
    return out
