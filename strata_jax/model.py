"""The MoE decoder's building blocks: attention, routing, the MoE block, the LM head.

Pure functions of one layer's dense params (`lp`, one entry of the stacked params the step
scans) and the residual stream. `step.py` composes them into the one compiled program per
step (docs/design.md); the quantizer calls them layer by layer. Expert weights arrive apart,
as an `ExpertPool` plus the slot of each of the layer's experts (docs/design.md, "Seams").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from strata_jax.config import ModelConfig
from strata_jax.int4_kernel import Int4Tiles
from strata_jax.layers import apply_rope, attend, einsum_f32, rms_norm, rope_tables
from strata_jax.moe import ExpertPool, Routing, apply_experts, route

Params = dict[str, Any]


def resident_slot_table(cfg: ModelConfig) -> jax.Array:
    """Slot table of a fully resident pool laid out [layer * num_experts + expert]."""
    ids = jnp.arange(cfg.num_layers * cfg.num_experts, dtype=jnp.int32)
    return ids.reshape(cfg.num_layers, cfg.num_experts)


def linear(x: jax.Array, lp: Params, name: str) -> jax.Array:
    """x @ lp[name]; an int8 matrix carries a per-output-channel scale applied after the dot."""
    w = lp[name]
    scale = lp.get(f"{name}_scale")
    if scale is None:
        return x @ w
    return (x @ w.astype(x.dtype)) * scale.astype(x.dtype)


def project_qkv(cfg: ModelConfig, lp: Params, h: jax.Array, positions: jax.Array):
    """q [B,T,Hq,hd], k/v [B,T,Hkv,hd] with the family's q/k norm and RoPE applied."""
    b, t, _ = h.shape
    qkv = linear(h, lp, "wqkv")
    if cfg.attention_bias:
        qkv = qkv + lp["bqkv"]
    q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    if cfg.qk_norm == "full":
        q, k = rms_norm(q, lp["q_norm"], cfg.rms_eps), rms_norm(k, lp["k_norm"], cfg.rms_eps)
    if cfg.clip_qkv is not None:
        c = cfg.clip_qkv
        q, k, v = jnp.clip(q, -c, c), jnp.clip(k, -c, c), jnp.clip(v, -c, c)
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm == "head":
        q, k = rms_norm(q, lp["q_norm"], cfg.rms_eps), rms_norm(k, lp["k_norm"], cfg.rms_eps)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def route_layer(cfg: ModelConfig, lp: Params, x: jax.Array) -> tuple[jax.Array, Routing]:
    """The MoE input [N, D] of residual stream x and its routing (what moe_block will use)."""
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_eps).reshape(-1, x.shape[-1])
    return h, route(h, lp["router"], cfg.top_k, cfg.norm_topk_prob, lp.get("router_bias"))


def moe_block(
    cfg: ModelConfig, lp: Params, x: jax.Array, pool: ExpertPool, slot_row: jax.Array,
    row_chunks: bool | None = None, int4_tiles: Int4Tiles | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Residual MoE FFN (routed + optional gated shared expert); also the selected experts.
    `row_chunks`, `int4_tiles`: see `moe.routed_outputs`."""
    h, routing = route_layer(cfg, lp, x)
    out = apply_experts(h, routing, pool, slot_row, row_chunks, int4_tiles)
    return x + with_shared(cfg, lp, h, out).reshape(x.shape), routing.experts


def with_shared(cfg: ModelConfig, lp: Params, h: jax.Array, out: jax.Array) -> jax.Array:
    """Add the (optionally gated) shared expert's output to the routed experts' `out`."""
    if not cfg.has_shared_expert:
        return out
    gate, up = linear(h, lp, "shared_w1"), linear(h, lp, "shared_w3")
    shared = linear(jax.nn.silu(gate) * up, lp, "shared_w2")
    if cfg.shared_gate:
        shared = jax.nn.sigmoid(h @ lp["shared_gate"][:, None]) * shared
    return out + shared


def lm_head(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    h = rms_norm(x, params["final_norm"], cfg.rms_eps)
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return einsum_f32("...d,vd->...v", h, w)


def causal_attention(cfg, lp, x, positions):
    """The attention half of a layer over a whole prefix (residual included), with its k, v."""
    o, k, v = attention_heads(cfg, lp, x, positions)
    return x + linear(o, lp, "wo"), k, v


def attention_heads(cfg, lp, x, positions):
    """Causal attention of a whole prefix before wo: (wo's input [B, T, Q], k, v)."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
    q, k, v = project_qkv(cfg, lp, h, positions)
    t = x.shape[1]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), jnp.bool_)), (x.shape[0], t, t))
    return attend(q, k, v, mask), k, v
