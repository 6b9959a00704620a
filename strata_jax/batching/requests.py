"""Running a list of prompts through the scheduler on any engine of the contract: each
request's tokens, or why it alone failed (`run_requests`, `generate_all`), and the sampling
settings of each (`per_request`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from strata_jax.batching.contract import EngineContract
from strata_jax.batching.scheduler import Scheduler
from strata_jax.step.sampling import GREEDY, SamplingParams


def per_request(sampling: SamplingParams | Sequence[SamplingParams],
                count: int) -> list[SamplingParams]:
    """One SamplingParams per request, each with its seed fixed (None draws one now)."""
    if isinstance(sampling, SamplingParams):
        sampling = [sampling] * count
    sampling = list(sampling)
    if len(sampling) != count:
        raise ValueError(f"{len(sampling)} SamplingParams for {count} prompts")
    return [dataclasses.replace(s, seed=s.resolved_seed()) for s in sampling]


@dataclass(frozen=True)
class RequestResult:
    """A request's new tokens, or why it failed (the other requests are unaffected)."""

    tokens: list[int]
    error: str | None = None


class RequestFailed(RuntimeError):
    """Some requests failed; `results` holds every request's outcome."""

    def __init__(self, failed: dict[int, str], results: list[RequestResult]) -> None:
        lines = "; ".join(f"request {i}: {msg}" for i, msg in sorted(failed.items()))
        super().__init__(f"{len(failed)} of {len(results)} requests failed: {lines}")
        self.results = results


def run_requests(engine: EngineContract, prompts: list[list[int]], max_new_tokens: int,
                 sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
                 tokenizer=None) -> list[RequestResult]:
    """One RequestResult per prompt (any number: continuous batching over the engine's rows);
    `sampling` for every prompt, or one per prompt; `tokenizer` matches their stop strings.
    A request the scheduler refuses (an empty prompt, ids outside the vocabulary, more tokens
    than max_len) gets its error and the others run."""
    sched = Scheduler(engine, tokenizer)
    reqs: list = []
    for p, s in zip(prompts, per_request(sampling, len(prompts)), strict=True):
        try:
            reqs.append(sched.submit(p, max_new_tokens, s))
        except ValueError as e:
            reqs.append(RequestResult([], str(e)))  # names the request
    sched.run()
    return [r if isinstance(r, RequestResult) else
            RequestResult(r.tokens if r.error is None else [], r.error) for r in reqs]


def generate_all(engine: EngineContract, prompts: list[list[int]], max_new_tokens: int,
                 sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
                 tokenizer=None) -> list[list[int]]:
    """`run_requests`' tokens; RequestFailed if any request failed."""
    results = run_requests(engine, prompts, max_new_tokens, sampling, tokenizer)
    failed = {i: r.error for i, r in enumerate(results) if r.error}
    if failed:
        raise RequestFailed(failed, results)
    return [r.tokens for r in results]
