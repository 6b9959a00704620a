"""Sampling inside the step: the filters against a float64 numpy reference, the draw's
distribution, the penalty, and per-request reproducibility whatever shares the batch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax import api
from strata_jax.step import sampling
from strata_jax.step.sampling import SamplingParams
from tests.helpers import random_model, tiny_config

# the model tests' family and shape: one set of compiled programs (prefill, greedy and sampled
# decode) serves all three
MODEL, SHAPE = "mixtral", {"batch_capacity": 4, "max_len": 32}


def rows_of(settings: list[SamplingParams], vocab: int, seen=None) -> sampling.SamplerRows:
    rows = sampling.greedy_rows(len(settings), vocab)
    for i, s in enumerate(settings):
        rows = sampling.set_row(rows, i, sampling.row_values(s), True)
    if seen is not None:
        rows = rows.replace(seen=jnp.asarray(seen))
    return rows


def reference_probs(logits: np.ndarray, s: SamplingParams) -> np.ndarray:
    """float64: temperature, top-k, top-p over what top-k kept, min-p; [V] probabilities."""
    x = logits.astype(np.float64) / (s.temperature or 1.0)
    order = np.argsort(-x, kind="stable")
    kept = np.zeros(x.shape, bool)
    k = s.top_k or len(x)
    kept[order[:k]] = True
    p = np.where(kept, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    mass = 0.0
    for i in order[:k]:
        if mass >= s.top_p and i != order[0]:
            kept[i] = False
        mass += p[i]
    kept &= p >= s.min_p * p.max()
    q = np.where(kept, p, 0.0)
    return q / q.sum()


SETTINGS = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
            SamplingParams(temperature=1.0, top_p=0.6),
            SamplingParams(temperature=0.9, top_k=12, top_p=0.9, min_p=0.05),
            SamplingParams(temperature=2.0, min_p=0.2)]


def kept_probs(logits: np.ndarray, settings: list[SamplingParams]) -> np.ndarray:
    """float64 [B, V]: `sampling.kept_logits` turned into each row's probabilities."""
    kept = np.asarray(sampling.kept_logits(jnp.asarray(logits),
                                           rows_of(settings, logits.shape[1])), np.float64)
    probs = np.exp(kept - kept.max(axis=1, keepdims=True))
    return probs / probs.sum(axis=1, keepdims=True)


def assert_matches_reference(logits: np.ndarray, settings: list[SamplingParams]) -> None:
    got = kept_probs(logits, settings)
    for i, s in enumerate(settings):
        want = reference_probs(logits[i], s)
        assert np.array_equal(got[i] > 0, want > 0), f"row {i} ({s}): a different support"
        np.testing.assert_allclose(got[i], want, atol=1e-6, err_msg=f"row {i} ({s})")


def test_filtered_distribution_matches_float64_reference():
    rng = np.random.default_rng(0)
    assert_matches_reference(rng.normal(0, 2, (len(SETTINGS), 64)).astype(np.float32), SETTINGS)


def test_filters_on_a_large_vocabulary_match_the_reference():
    """Kept sets of every size, flat rows whose top-p reaches far down, top-k past a few
    hundred tokens, and filters that combine."""
    vocab = 1024
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (8, vocab)).astype(np.float32)
    logits[3:6] = rng.normal(0, 0.01, (3, vocab))  # nearly flat
    settings = [SamplingParams(temperature=1.0, top_p=0.6),
                SamplingParams(temperature=1.3, top_k=7),
                SamplingParams(temperature=0.9, min_p=0.1),
                SamplingParams(temperature=1.0, top_p=0.99),
                SamplingParams(temperature=1.0, top_k=300),
                SamplingParams(temperature=1.0, top_k=300, top_p=0.5),
                SamplingParams(temperature=0.5, top_k=600, top_p=0.97, min_p=0.01),
                SamplingParams(temperature=2.0, top_p=1.0)]
    assert_matches_reference(logits, settings)


def test_ties_are_ranked_by_index():
    """Equal logits (-0.0 and 0.0 too) at the edge of the top-k and top-p sets: the
    lower indices stay, as a stable sort ranks them."""
    rng = np.random.default_rng(4)
    logits = rng.choice(np.array([-1.0, -0.0, 0.0, 0.5, 2.0], np.float32), (6, 96))
    settings = [SamplingParams(temperature=1.0, top_k=k) for k in (1, 3, 10, 40)] + [
        SamplingParams(temperature=1.0, top_p=p) for p in (0.3, 0.8)]
    assert_matches_reference(logits, settings)


def draw_frequencies(logits: np.ndarray, setting: SamplingParams, draws: int,
                     position: int) -> np.ndarray:
    """Token frequencies of `draws` draws from `logits` [V] by `setting`: the row's settings
    tiled over `draws` rows of other seeds."""
    rows = rows_of([setting], len(logits))
    rows = rows.replace(**{k: jnp.repeat(getattr(rows, k), draws, axis=0)
                           for k in ("temperature", "top_k", "top_p", "min_p", "penalty",
                                     "seen")},
                        seed=jnp.stack([jnp.zeros(draws, jnp.uint32),
                                        jnp.arange(draws, dtype=jnp.uint32)], axis=1))
    tokens = sampling.sample(jnp.tile(jnp.asarray(logits), (draws, 1)), rows,
                             jnp.full((draws,), position))
    return np.bincount(np.asarray(tokens), minlength=len(logits)) / draws


def test_draws_follow_the_distribution():
    draws = 4000
    logits = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 0.8, 1.9], np.float32)
    s = SamplingParams(temperature=0.8, top_k=6, top_p=0.95)
    freq = draw_frequencies(logits, s, draws, 3)
    want = reference_probs(logits, s)
    assert np.all(freq[want == 0] == 0)
    sigma = np.sqrt(want * (1 - want) / draws)
    assert np.all(np.abs(freq - want) <= 4 * sigma + 1e-9), (freq, want)


def test_greedy_rows_take_the_argmax_and_a_penalty_of_one_keeps_the_bits():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 1, (3, 50)).astype(np.float32))
    seen = rng.random((3, 50)) < 0.3
    rows = rows_of([sampling.GREEDY] * 3, 50, seen)
    assert np.array_equal(np.asarray(sampling.penalize(logits, rows)), np.asarray(logits))
    tokens = sampling.sample(logits, rows, jnp.zeros(3, jnp.int32))
    assert np.array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), -1))


def test_repetition_penalty_as_transformers_defines_it():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1, (2, 40)).astype(np.float32)
    seen = rng.random((2, 40)) < 0.5
    rows = rows_of([SamplingParams(repetition_penalty=1.3),
                    SamplingParams(repetition_penalty=0.7)], 40, seen)
    got = np.asarray(sampling.penalize(jnp.asarray(logits), rows))
    for i, p in enumerate((1.3, 0.7)):
        want = np.where(logits[i] > 0, logits[i] / p, logits[i] * p)
        np.testing.assert_allclose(got[i], np.where(seen[i], want, logits[i]), rtol=1e-6)


def test_greedy_with_penalty_matches_a_reference_loop():
    """Penalized greedy decoding through the step equals a numpy loop over the full forward's
    logits (the penalty over prompt and generated tokens)."""
    cfg = tiny_config(MODEL)
    m = random_model(cfg, seed=4)
    prompt, new, penalty = [3, 9, 3, 27, 8], 6, 1.8
    got = api.generate(m, [prompt], new, sampling=SamplingParams(repetition_penalty=penalty),
                       **SHAPE)[0]
    seq = list(prompt)
    for _ in range(new):  # the causal forward of the sequence padded to one length
        padded = seq + [0] * (len(prompt) + new - len(seq))
        x = api.logits(m, [padded])[0, len(seq) - 1].astype(np.float64)
        hit = np.zeros(cfg.vocab_size, bool)
        hit[seq] = True
        x = np.where(hit, np.where(x > 0, x / penalty, x * penalty), x)
        seq.append(int(np.argmax(x)))
    assert got == seq[len(prompt):]
    assert got != api.generate(m, [prompt], new, **SHAPE)[0]  # the penalty changed tokens


def test_a_seeded_request_gives_its_tokens_whatever_shares_the_batch():
    cfg = tiny_config(MODEL)
    m = random_model(cfg, seed=5)
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.5, seed=7), sampling.GREEDY,
              SamplingParams(temperature=1.5, top_k=3)]
    alone = api.generate(m, [[1, 2, 3]], 10, sampling=mine, **SHAPE)[0]
    batch = api.generate(m, [[9, 9], [5], [1, 2, 3], [4, 4, 4, 4]], 10,
                         sampling=[others[0], others[1], mine, others[2]], **SHAPE)
    assert batch[2] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=1235)
    assert api.generate(m, [[1, 2, 3]], 10, sampling=other_seed, **SHAPE)[0] != alone


def test_stop_ids_end_a_request_and_bad_settings_are_refused():
    cfg = tiny_config(MODEL)
    m = random_model(cfg, seed=6)
    full = api.generate(m, [[1, 2, 3]], 8, **SHAPE)[0]
    stop = full[3]
    out = api.generate(m, [[1, 2, 3]], 8, sampling=SamplingParams(stop_ids={stop}), **SHAPE)[0]
    assert out == full[: full.index(stop) + 1]
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"min_p": 1.5},
                {"repetition_penalty": 0}, {"stop": ("",)}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        api.generate(m, [[1]], 4, sampling=[sampling.GREEDY] * 2)


@pytest.mark.parametrize("setting", [SamplingParams(temperature=0.8),  # no filter
                                     SamplingParams(temperature=1.0, top_p=0.9),  # a few kept
                                     SamplingParams(temperature=1.0, top_p=0.999)])  # most kept
def test_draws_follow_the_distribution_on_a_large_vocabulary(setting):
    vocab, draws = 512, 3000
    rng = np.random.default_rng(2)
    logits = (rng.normal(0, 1, vocab) + np.where(np.arange(vocab) < 6, 5.0, 0.0)).astype(
        np.float32)
    if setting.top_p > 0.99:
        logits = rng.normal(0, 0.05, vocab).astype(np.float32)  # flat
    freq = draw_frequencies(logits, setting, draws, 5)
    want = reference_probs(logits, setting)
    assert np.all(freq[want == 0] == 0)
    sigma = np.sqrt(want * (1 - want) / draws)
    assert np.all(np.abs(freq - want) <= 4.5 * sigma + 1.5 / draws), (freq, want)


def test_a_rows_draw_does_not_depend_on_how_the_others_draw():
    vocab = 512
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, (3, vocab)).astype(np.float32)
    logits[0] = rng.normal(0, 0.05, vocab)  # its top-p 0.999 keeps most of the vocabulary
    settings = [SamplingParams(temperature=1.0, top_p=0.999, seed=1),
                SamplingParams(temperature=0.7, top_p=0.5, seed=2),
                SamplingParams(temperature=1.1, seed=3)]
    together = sampling.sample(jnp.asarray(logits), rows_of(settings, vocab),
                               jnp.full((3,), 7))
    for i, s in enumerate(settings):
        alone = sampling.sample(jnp.asarray(logits[i:i + 1]), rows_of([s], vocab),
                                jnp.full((1,), 7))
        assert int(alone[0]) == int(together[i])


def test_top_p_of_one_keeps_every_token():
    """Even where float32 partial sums of the probabilities reach 1 before the last token."""
    vocab = 4096
    logits = np.zeros((1, vocab), np.float32)
    logits[0, :8] = 30.0  # nearly all the mass in 8 tokens, the rest ~1e-13 each
    got = kept_probs(logits, [SamplingParams(temperature=1.0, top_p=1.0)])
    assert (got[0] > 0).all()
