"""Multi-token prediction (DeepSeek-V3, GLM-4.5): the module that drafts the token after next.

Module k of `ModelConfig.mtp_layers` reads, at position i, the model's last hidden state h_i
(before the final norm) and the embedding of token i + 1, both RMS-normed, projects their
concatenation back to the hidden size (`eh_proj`), runs one MoE decoder layer over the
sequence (causal attention with its own params and cache, its own experts) and its head's
norm, then the model's own LM head (DeepSeek-V3 shares the embedding and the output head):
logits for token i + 2. It is the draft source for speculative decoding; here it runs over
whole sequences, fully resident.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from strata_jax.formats.config import ModelConfig
from strata_jax.model.decoder import causal_attention, moe_block
from strata_jax.model.flax_model import MoEModel, model_for
from strata_jax.ops.layers import einsum_f32, rms_norm
from strata_jax.ops.pool import ExpertPool
from strata_jax.step.plan import StepPlan, Tiers


def last_hidden(cfg: ModelConfig, params: dict[str, Any], pool: ExpertPool, tiers: Tiers,
                tokens: jax.Array) -> jax.Array:
    """The model's final stream [B, T, D] of tokens [B, T] before the final norm (what the
    MTP module reads), from the full causal forward with every expert resident."""
    b, t = tokens.shape
    k, v = (jnp.zeros(s, jnp.dtype(cfg.dtype)) for s in cfg.cache_shapes(b, t))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    live = jnp.ones((b * t,), jnp.bool_)
    out, _ = model_for(cfg, StepPlan(), params).apply(
        params, tokens, positions, live, pool, tiers, k, v, every=True, method=MoEModel.chunk)
    return out["every"]


def mtp_input(cfg: ModelConfig, mtp: dict[str, jax.Array], embedded: jax.Array,
              hidden: jax.Array) -> jax.Array:
    """The module's decoder-layer input [..., D]: the next tokens' embeddings `embedded` and
    the model's `hidden` states, each RMS-normed, concatenated and projected (`eh_proj`). One
    owner: the module's forward and `strata quantize`'s calibration of it both call it."""
    e = rms_norm(embedded, mtp["enorm"], cfg.rms_eps)
    h = rms_norm(hidden, mtp["hnorm"], cfg.rms_eps)
    return jnp.concatenate([e, h.astype(e.dtype)], axis=-1) @ mtp["eh_proj"]


def mtp_logits(cfg: ModelConfig, params: dict[str, Any], mtp: dict[str, jax.Array],
               pool: ExpertPool, hidden: jax.Array, next_tokens: jax.Array) -> jax.Array:
    """float32 logits [B, T, V] of the token after next: `hidden` [B, T, D] the model's
    `last_hidden`, `next_tokens` [B, T] the token after each position; `mtp` one module's
    dense params (q/k/v fused), `pool` its experts in slots 0..E-1."""
    g = params["params"]
    t = hidden.shape[1]
    x = mtp_input(cfg, mtp, g["embed"][next_tokens], hidden)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), next_tokens.shape)
    x, _, _ = causal_attention(cfg, mtp, x, positions)
    x, _ = moe_block(cfg, mtp, x, pool, jnp.arange(cfg.num_experts, dtype=jnp.int32))
    head = g["embed"] if cfg.tie_word_embeddings else g["lm_head"]
    return einsum_f32("btd,vd->btv", rms_norm(x, mtp["head_norm"], cfg.rms_eps), head)
