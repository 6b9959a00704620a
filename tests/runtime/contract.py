"""Driving an engine through its contract (prefill / step / free) in the tests."""

from __future__ import annotations

import numpy as np

from strata_runtime.engine import Engine


def run_rows(engine: Engine, prompts: list[list[int]], new: int):
    """Prefill each prompt into its own row, then `new - 1` decode steps: every row's tokens
    [rows, new] and the logits of every decode step [new - 1, rows, vocab]."""
    first = []
    for row, prompt in enumerate(prompts):
        token, error = engine.prefill(row, prompt)
        assert error is None, error
        first.append(token)
    tokens, logits = [np.array(first)], []
    for _ in range(new - 1):
        result = engine.step()
        assert not result.failed, result.failed
        tokens.append(result.tokens[: len(prompts)])
        logits.append(np.asarray(result.logits)[: len(prompts)])
    for row in range(len(prompts)):
        engine.free(row)
    return np.stack(tokens, axis=1), np.stack(logits)
