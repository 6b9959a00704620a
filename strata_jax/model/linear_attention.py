"""Gated DeltaNet: the token mixer of Qwen3-Next's linear layers (`ModelConfig.linear_layers`).

Per layer and row, the decode state is fixed in size: the last `linear_conv_kernel - 1` inputs
of a short causal depthwise convolution (the conv state) and, per value head, a recurrent
matrix S [key dim, value dim] (float32). Each token: q, k, v from the convolution (silu), q
and k L2-normalized (q also by key dim ** -0.5), then the gated delta rule

    S <- S * exp(g);  S <- S + k (beta * (v - k^T S))^T;  o = q^T S

with the decay g = -exp(a_log) * softplus(a + dt_bias) and the rate beta = sigmoid(b), and
the output is RMS-normed per value head, gated by silu(z) and projected by w_out. A chunk of
tokens runs the rule as a scan over its tokens (exact; a chunked form is later work). A row's
state depends on its own tokens only (batch invariance), and a token at position 0 starts
from a zero state, so a row reused by a new prompt carries nothing over.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from strata_jax.formats.config import ModelConfig
from strata_jax.model.decoder import linear
from strata_jax.ops.layers import rms_norm

Params = dict[str, Any]
L2_EPS = 1e-6
"""The epsilon of the L2 norm of q and k (transformers' and the FLA kernels')."""


def _project(cfg: ModelConfig, lp: Params, h: jax.Array):
    """(conv input [B, T, conv dim], z [B, T, Hv, dv], b [B, T, Hv], a [B, T, Hv])."""
    qkvz = linear(h, lp, "w_qkvz")
    ba = linear(h, lp, "w_ba")
    hv = cfg.linear_value_heads
    qkv, z = qkvz[..., :cfg.linear_conv_dim], qkvz[..., cfg.linear_conv_dim:]
    z = z.reshape(*z.shape[:-1], hv, cfg.linear_value_dim)
    return qkv, z, ba[..., :hv], ba[..., hv:]


def causal_conv(seq: jax.Array, weight: jax.Array, dtype) -> jax.Array:
    """silu of the depthwise causal convolution over seq [B, K - 1 + T, C] (the conv state,
    then the chunk's inputs) with weight [K, C]: [B, T, C] in `dtype`, summed in float32."""
    taps = weight.shape[0]
    t = seq.shape[1] - taps + 1
    seq32, w32 = seq.astype(jnp.float32), weight.astype(jnp.float32)
    out = seq32[:, 0:t] * w32[0]
    for j in range(1, taps):
        out = out + seq32[:, j:j + t] * w32[j]
    return jax.nn.silu(out).astype(dtype)


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def delta_rule(q, k, v, g, beta, state, valid):
    """The gated delta rule over a chunk, one token at a time, in float32: q, k [B, T, H, dk]
    (normed, q scaled; heads already repeated to the value heads), v [B, T, H, dv], g and
    beta [B, T, H], state [B, H, dk, dv], valid [B, T] (a token that is not leaves the state
    as it is). Returns (o [B, T, H, dv], the final state)."""

    def step(s, xs):
        q_t, k_t, v_t, g_t, beta_t, valid_t = xs
        decayed = s * jnp.exp(g_t)[..., None, None]
        predicted = jnp.sum(decayed * k_t[..., :, None], axis=-2)
        delta = (v_t - predicted) * beta_t[..., None]
        new = decayed + k_t[..., :, None] * delta[..., None, :]
        o_t = jnp.sum(new * q_t[..., :, None], axis=-2)
        return jnp.where(valid_t[:, None, None, None], new, s), o_t

    time_major = [jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta)]
    state, o = jax.lax.scan(step, state, (*time_major, jnp.moveaxis(valid, 1, 0)))
    return jnp.moveaxis(o, 0, 1), state


def _heads(cfg: ModelConfig, qkv: jax.Array):
    """q, k [B, T, Hv, dk] (L2-normed, q scaled, each key head repeated for its value
    heads) and v [B, T, Hv, dv], float32, from the convolution's output."""
    kh, dk, hv = cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_heads
    shape = qkv.shape[:-1]
    q, k, v = jnp.split(qkv.astype(jnp.float32), [kh * dk, 2 * kh * dk], axis=-1)
    q = _l2norm(q.reshape(*shape, kh, dk)) * dk ** -0.5
    k = _l2norm(k.reshape(*shape, kh, dk))
    per = hv // kh
    return (jnp.repeat(q, per, axis=-2), jnp.repeat(k, per, axis=-2),
            v.reshape(*shape, hv, cfg.linear_value_dim))


def _last_inputs(seq: jax.Array, counts: jax.Array, taps: int) -> jax.Array:
    """Each row's conv state after its `counts` real tokens: the K - 1 inputs ending there."""
    return jax.vmap(lambda s, n: jax.lax.dynamic_slice_in_dim(s, n, taps - 1))(seq, counts)


def gated_delta_net(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array,
                    conv_all: jax.Array, rec_all: jax.Array, slot, row, max_len: int):
    """The linear layer's token mixer over a chunk x [B, T, D] at `positions` [B, T] (at or
    past `max_len`: not a token of the row; real tokens come first), residual included. Chunk
    row b reads and writes state row `row[b]` (None: row b; at or past the capacity: a padding
    row, which writes nothing) of linear layer `slot` of the states conv_all [L_lin, B, K - 1,
    C] and rec_all [L_lin, B, Hv, dk, dv]. Returns (x, conv_all, rec_all)."""
    b, t, _ = x.shape
    capacity = conv_all.shape[1]
    rows = jnp.arange(b) if row is None else row
    own = jnp.minimum(rows, capacity - 1)
    valid = positions < max_len
    counts = jnp.sum(valid, axis=1, dtype=jnp.int32)
    fresh = (positions[:, 0] == 0)[:, None, None]
    conv0 = jnp.where(fresh, 0, conv_all[slot, own])
    rec0 = jnp.where(fresh[..., None], 0, rec_all[slot, own])

    h = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
    qkv, z, beta_in, a = _project(cfg, lp, h)
    seq = jnp.concatenate([conv0, qkv.astype(conv0.dtype)], axis=1)
    mixed = causal_conv(seq, lp["conv"], x.dtype)
    q, k, v = _heads(cfg, mixed)
    g = -jnp.exp(lp["a_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + lp["dt_bias"].astype(jnp.float32))
    o, rec = delta_rule(q, k, v, g, jax.nn.sigmoid(beta_in), rec0, valid)
    o = rms_norm(o.astype(x.dtype), lp["out_norm"], cfg.rms_eps)
    o = (o.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)

    target = jnp.where(counts > 0, rows, capacity)  # rows with no token here keep their state
    conv_all = conv_all.at[slot, target].set(
        _last_inputs(seq, counts, cfg.linear_conv_kernel), mode="drop")
    rec_all = rec_all.at[slot, target].set(rec, mode="drop")
    return linear(o.reshape(b, t, -1), lp, "w_out", x), conv_all, rec_all
