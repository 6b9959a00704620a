"""Driving an engine through its contract (prefill / step / read / free) in the tests, and the
resident forward's routing of requests, which engine records are checked against."""

from __future__ import annotations

import numpy as np

import strata_jax
from strata_jax.batching.packing import Admission
from strata_runtime.engine.offload import Engine


def run_rows(engine: Engine, prompts: list[list[int]], new: int):
    """Prefill each prompt into its own row, then `new - 1` decode steps: every row's tokens
    [rows, new] and the logits of every decode step [new - 1, rows, vocab]."""
    first = []
    for done in engine.prefill([Admission(row, p) for row, p in enumerate(prompts)]):
        assert done.error is None, done.error
        first.append(done.token)
    tokens, logits = [np.array(first)], []
    for _ in range(new - 1):
        result = engine.step()
        assert not result.failed, result.failed
        tokens.append(engine.read(result)[: len(prompts)])
        logits.append(np.asarray(result.logits)[: len(prompts)])
    for row in range(len(prompts)):
        engine.free(row)
    return np.stack(tokens, axis=1), np.stack(logits)


def routing(model, seqs: list[list[int]]) -> list[np.ndarray]:
    """Each sequence's experts [layers, len, top_k] in the resident causal forward: one
    forward of the sequences padded to one length (one program, not one per length), since a
    token's routing does not depend on the tokens after it."""
    width = max(map(len, seqs))
    batch = np.array([s + [0] * (width - len(s)) for s in seqs], np.int32)
    routes = strata_jax.api.routing(model, batch)
    routes = routes.reshape(routes.shape[0], len(seqs), width, -1)
    return [routes[:, i, :len(s)] for i, s in enumerate(seqs)]
