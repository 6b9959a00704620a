"""The engine contract: the engines implement it, and the scheduler drives the fake engine
(`batching.fake`) to the tokens and log-probabilities the fake model defines, whatever the
mix of requests joining, kept, resumed, evicted and cancelled."""

import numpy as np
import pytest

from strata_jax.batching import fake
from strata_jax.batching.contract import EngineContract
from strata_jax.batching.fake import FakeEngine
from strata_jax.batching.scheduler import Scheduler
from tests.helpers import tiny_config

CFG = tiny_config("olmoe")


def _alone(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The fake model's greedy continuation of `prompt` and each token's log-probability,
    computed here without the engine or the scheduler."""
    seq, tokens, logps = list(prompt), [], []
    for _ in range(n):
        token = fake.next_token(seq, CFG.vocab_size)
        logps.append(float(fake.log_softmax(fake.logits(seq, CFG.vocab_size))[token]))
        tokens.append(token)
        seq.append(token)
    return tokens, logps


def test_every_engine_implements_the_contract(tmp_path):
    import strata_jax
    from strata_jax.batching.resident import ResidentEngine
    from strata_runtime.engine.config import EngineConfig
    from strata_runtime.engine.offload import Engine
    from tests.helpers import write_checkpoint

    write_checkpoint(CFG, tmp_path / "ck", seed=0)
    assert isinstance(FakeEngine(CFG, 2, 32), EngineContract)
    assert isinstance(ResidentEngine(strata_jax.load(tmp_path / "ck"), 2, 32), EngineContract)
    with Engine.from_checkpoint(tmp_path / "ck", EngineConfig(batch_capacity=2, max_len=32)) \
            as engine:
        assert isinstance(engine, EngineContract)
    assert not isinstance(object(), EngineContract)


@pytest.mark.parametrize("seed", range(6))
def test_scheduler_over_the_fake_gives_each_request_its_own_tokens(seed):
    rng = np.random.default_rng(seed)
    engine = FakeEngine(CFG, capacity=3, max_len=64)
    sched = Scheduler(engine)
    prompts = [rng.integers(0, CFG.vocab_size, rng.integers(1, 12)).tolist() for _ in range(9)]
    counts = [int(rng.integers(1, 10)) for _ in prompts]
    reqs = []
    for i, (prompt, n) in enumerate(zip(prompts, counts, strict=True)):
        reqs.append(sched.submit(prompt, n, logprobs=i % 2 == 0, keep=i == 3))
        for _ in range(int(rng.integers(0, 3))):
            sched.step()
    cancelled = reqs[5]
    sched.step()
    sched.cancel(cancelled)
    sched.run()
    for i, (req, prompt, n) in enumerate(zip(reqs, prompts, counts, strict=True)):
        tokens, logps = _alone(prompt, n)
        if req.cancelled:  # unless it had finished first
            assert req is cancelled and req.tokens == tokens[: len(req.tokens)]
            continue
        assert req.tokens == tokens, i
        if req.logprobs:
            assert [s.logprob for s in req.token_scores] == pytest.approx(logps, abs=1e-5)
            assert all(s.top_ids[0] == t for s, t in zip(req.token_scores, tokens, strict=True))
    kept = reqs[3]
    sched.resume(kept, [7, 8], 4)  # its row was likely evicted by later requests: prefilled anew
    sched.run()
    assert kept.tokens[counts[3]:] == _alone(prompts[3] + kept.tokens[:counts[3]] + [7, 8], 4)[0]
