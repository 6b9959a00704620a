"""The Gated DeltaNet token mixer (`model/linear_attention.py`): the delta rule against a
float64 numpy recurrence; a chunk's conv and recurrent states carry over (a prompt in pieces
is the prompt whole) and a row's state never depends on another row's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from strata_jax.model.linear_attention import causal_conv, delta_rule, gated_delta_net
from tests.helpers import random_mixers, tiny_config


def _reference_rule(q, k, v, g, beta, state):
    """The gated delta rule token by token in float64 (numpy)."""
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, state))
    out = np.zeros_like(v)
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None, None]
        predicted = np.einsum("bhkv,bhk->bhv", s, k[:, t])
        delta = (v[:, t] - predicted) * beta[:, t][..., None]
        s = s + np.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
    return out, s


def _inputs(rng, b=2, t=7, h=3, dk=5, dv=4):
    unit = rng.normal(size=(2, b, t, h, dk))
    q, k = unit / np.linalg.norm(unit, axis=-1, keepdims=True)
    return (q.astype(np.float32), k.astype(np.float32),
            rng.normal(size=(b, t, h, dv)).astype(np.float32),
            -rng.uniform(0.05, 1.0, size=(b, t, h)).astype(np.float32),
            rng.uniform(0.1, 0.9, size=(b, t, h)).astype(np.float32),
            rng.normal(size=(b, h, dk, dv)).astype(np.float32))


def test_delta_rule_matches_a_float64_recurrence():
    q, k, v, g, beta, s0 = _inputs(np.random.default_rng(0))
    valid = np.ones(q.shape[:2], bool)
    out, state = delta_rule(q, k, v, g, beta, s0, valid)
    ref_out, ref_state = _reference_rule(q, k, v, g, beta, s0)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, ref_state, rtol=1e-5, atol=1e-5)


def test_tokens_that_are_not_real_leave_the_state():
    q, k, v, g, beta, s0 = _inputs(np.random.default_rng(1))
    valid = np.zeros(q.shape[:2], bool)
    valid[0, :4] = True  # row 0: 4 real tokens, then padding; row 1: none
    _, state = delta_rule(q, k, v, g, beta, s0, valid)
    _, ref = _reference_rule(q[:1, :4], k[:1, :4], v[:1, :4], g[:1, :4], beta[:1, :4], s0[:1])
    np.testing.assert_allclose(state[0], ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(state[1], s0[1])


def test_causal_conv_matches_numpy():
    rng = np.random.default_rng(2)
    seq = rng.normal(size=(2, 3 + 6, 5)).astype(np.float32)
    w = rng.normal(size=(4, 5)).astype(np.float32)
    got = causal_conv(jnp.asarray(seq), jnp.asarray(w), jnp.float32)
    lin = sum(seq[:, j:j + 6].astype(np.float64) * w[j] for j in range(4))
    np.testing.assert_allclose(got, lin / (1 + np.exp(-lin)), rtol=1e-5, atol=1e-6)


def _layer(seed=3):
    cfg = tiny_config("qwen3_next")
    lp = {k: jnp.asarray(v[0]) for k, v in random_mixers(cfg, seed)["linear"].items()}
    lp["attn_norm"] = jnp.ones((cfg.hidden_size,), jnp.float32)
    return cfg, lp


def _states(cfg, batch, rng):
    """Nonzero states: a fresh row (position 0) must ignore them."""
    (conv, _), (rec, _) = cfg.linear_state_specs(batch)
    return (jnp.asarray(rng.normal(size=conv), jnp.float32),
            jnp.asarray(rng.normal(size=rec), jnp.float32))


def test_a_prompt_in_pieces_is_the_prompt_whole():
    """Chunks of 5 then 3, or one token at a time, carry the conv and recurrent states so
    that every output and the final states equal the whole prompt's (to float32 rounding)."""
    cfg, lp = _layer()
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(1, 8, cfg.hidden_size)), jnp.float32)
    conv, rec = _states(cfg, 1, rng)
    whole, conv_w, rec_w = gated_delta_net(cfg, lp, x, jnp.arange(8)[None], conv, rec, 1,
                                           None, 32)
    for cuts in ((0, 5, 8), tuple(range(9))):
        c, r, outs = conv, rec, []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            o, c, r = gated_delta_net(cfg, lp, x[:, a:b], jnp.arange(a, b)[None], c, r, 1,
                                      None, 32)
            outs.append(o)
        np.testing.assert_allclose(jnp.concatenate(outs, 1), whole, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(c, conv_w, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(r, rec_w, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(conv_w[0], conv[0])  # layer 0's states untouched
    np.testing.assert_array_equal(rec_w[0], rec[0])


def test_a_row_never_reads_another_rows_state():
    """Row 1 gives the same bits whatever row 0 holds, and padding tokens, padding rows and
    rows without a token write nothing."""
    cfg, lp = _layer()
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(3, 4, cfg.hidden_size)), jnp.float32)
    positions = jnp.asarray([[6, 7, 8, 9], [3, 4, 32, 32], [0, 1, 2, 3]])
    conv, rec = _states(cfg, 3, rng)
    row = jnp.asarray([0, 1, 3])  # the third is a padding row: past the capacity
    out, c1, r1 = gated_delta_net(cfg, lp, x, positions, conv, rec, 0, row, 32)
    other_conv = conv.at[:, 0].set(7.0)
    other_rec = rec.at[:, 0].set(-3.0)
    out2, c2, r2 = gated_delta_net(cfg, lp, x.at[0].set(1.0), positions, other_conv,
                                   other_rec, 0, row, 32)
    np.testing.assert_array_equal(out[1, :2], out2[1, :2])
    np.testing.assert_array_equal(c1[:, 1], c2[:, 1])
    np.testing.assert_array_equal(r1[:, 1], r2[:, 1])
    np.testing.assert_array_equal(c1[:, 2], conv[:, 2])  # no chunk row writes row 2
    np.testing.assert_array_equal(r1[:, 2], rec[:, 2])
    quiet = jnp.full((3, 4), 32)  # no real token anywhere: nothing changes
    _, c3, r3 = gated_delta_net(cfg, lp, x, quiet, conv, rec, 0, row, 32)
    np.testing.assert_array_equal(c3, conv)
    np.testing.assert_array_equal(r3, rec)
