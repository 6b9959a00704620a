"""Scoring: a continuation's log-likelihood given its context, against a float64 reference
computed from the full causal forward (`strata_jax.logits`), and through the offload engine
bit for bit as through the resident API."""

import numpy as np
import pytest

import strata_jax
from strata_jax.formats.checkpoint import CheckpointReader
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from tests.helpers import tiny_config, write_checkpoint

PAIRS = [([5, 9, 2, 7], [11, 3]), ([1], [4, 4, 4, 8, 2, 6]),
         ([(3 * i + 2) % 97 for i in range(40)], [17, 1, 33])]
SHAPE = {"batch_capacity": 2, "max_len": 64, "prefill_chunk": 16}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("score") / "ck"
    write_checkpoint(tiny_config("qwen3_moe", num_experts=8), path, seed=6)
    return path


def _reference(model, context, continuation):
    """Each continuation token's log-probability from the full forward, in float64."""
    tokens = np.array([list(context) + list(continuation)], np.int32)
    logits = strata_jax.logits(model, tokens)[0].astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    at = np.arange(len(context) - 1, len(context) - 1 + len(continuation))
    return logp[at, continuation], logits[at].argmax(-1)


def test_scores_match_the_full_forward_in_float64(ckpt):
    model = strata_jax.load(ckpt)
    got = strata_jax.score(model, PAIRS, **SHAPE)  # the 43-token pair spans three chunks
    for (context, continuation), like in zip(PAIRS, got, strict=True):
        want, argmax = _reference(model, context, continuation)
        np.testing.assert_allclose(like.token_logprobs, want, rtol=1e-4, atol=1e-4)
        assert like.logprob == pytest.approx(want.sum(), rel=1e-4, abs=1e-4)
        assert like.greedy == bool(np.all(argmax == continuation))
        assert all(lp < 0 for lp in like.token_logprobs)
    # the model's own greedy continuation is greedy, and scores above a changed token
    context = PAIRS[0][0]
    own = strata_jax.generate(model, [context], 3, **SHAPE)[0]
    best, other = strata_jax.score(model, [(context, own), (context, own[:2] + [
        (own[2] + 1) % model.config.vocab_size])], **SHAPE)
    assert best.greedy and not other.greedy and best.logprob > other.logprob


def test_the_offload_engine_scores_the_same_bits(ckpt):
    resident = strata_jax.score(strata_jax.load(ckpt), PAIRS, **SHAPE)
    config = EngineConfig(resident_experts=4, host_experts=6, **SHAPE)
    with Engine(CheckpointReader(ckpt), config) as engine:
        assert engine.plan.staging > 0
        assert engine.score(PAIRS) == resident
        assert engine.stats()["by_phase"]["prefill"]["totals"]["disk_loads"] > 0


def test_bad_pairs_are_refused(ckpt):
    model = strata_jax.load(ckpt)
    with pytest.raises(ValueError, match="pair 1: the context and the continuation each"):
        strata_jax.score(model, [([1], [2]), ([], [3])], **SHAPE)


def test_positions_are_scored_in_blocks_as_all_at_once(ckpt):
    """A 2 x 128 chunk's LM head in `SCORE_BLOCK`-position blocks against one float64 log-softmax
    of the whole [256, V] logits."""
    from strata_jax.model.decoder import lm_head
    from strata_jax.step import programs as step

    model = strata_jax.load(ckpt)
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((2, 128, model.config.hidden_size)).astype(np.float32)
    targets = rng.integers(-1, model.config.vocab_size, (2, 128)).astype(np.int32)
    got = step.score_positions(model.config, model.params, hidden, targets)
    assert 2 * 128 > step.SCORE_BLOCK
    logits = np.asarray(lm_head(model.config, model.params["params"], hidden), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = np.take_along_axis(logp, np.maximum(targets, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(got.target, np.where(targets >= 0, want, 0), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(got.top_ids[..., 0], logp.argmax(-1))


def _generated_scores(engine, prompts, sampling):
    """Each request's tokens and their `token_scores`, every request asking for them, the
    second joining while the first decodes (it rides no prefill: it scores its tokens)."""
    from strata_jax.batching.scheduler import Scheduler

    sched = Scheduler(engine)
    first = sched.submit(prompts[0], 6, sampling, logprobs=True)
    sched.step()
    sched.step()
    others = [sched.submit(p, 5, sampling, logprobs=i == 0) for i, p in enumerate(prompts[1:])]
    sched.run()
    return [(r.tokens, r.token_scores) for r in [first, *others]]


@pytest.mark.parametrize("seeded", [False, True])
def test_generated_tokens_are_scored_as_the_full_forward_and_offloaded_the_same(ckpt, seeded):
    """Each generated token's log-probability (greedy and seeded sampling) against float64 from
    the full causal forward over prompt + generated tokens; the offload engine gives the same
    bits; a request that asked for none has none."""
    from strata_jax.batching.resident import ResidentEngine
    from strata_jax.step.sampling import GREEDY, SamplingParams

    model = strata_jax.load(ckpt)
    sampling = SamplingParams(temperature=1.3, top_k=12, seed=4) if seeded else GREEDY
    prompts = [PAIRS[2][0], [5, 9, 2, 7], [8, 1]]
    got = _generated_scores(ResidentEngine(model, 2, 64, 16), prompts, sampling)
    for prompt, (tokens, scores) in zip(prompts[:2], got, strict=False):
        assert len(scores) == len(tokens) and tokens
        want, argmax = _reference(model, prompt, tokens)
        np.testing.assert_allclose([s.logprob for s in scores], want, rtol=1e-4, atol=1e-4)
        for s, token, best in zip(scores, tokens, argmax, strict=True):
            assert s.top_ids[0] == best and s.top[0] >= s.logprob
            assert np.all(np.diff(s.top) <= 0) and (token in s.top_ids) == (s.logprob >= s.top[-1])
            if not seeded:
                assert token == best
    assert got[2][1] == [] and len(got[2][0]) == 5
    config = EngineConfig(resident_experts=4, host_experts=6, batch_capacity=2, max_len=64,
                          prefill_chunk=16)
    with Engine(CheckpointReader(ckpt), config) as engine:
        offloaded = _generated_scores(engine, prompts, sampling)
    for (tokens, scores), (tokens2, scores2) in zip(got, offloaded, strict=True):
        assert tokens2 == tokens
        assert [s.logprob for s in scores2] == [s.logprob for s in scores]
        for a, b in zip(scores, scores2, strict=True):
            np.testing.assert_array_equal(a.top_ids, b.top_ids)
