"""Pure-functional MoE decoder: full forward, bucketed prefill and fixed-shape decode.

Dense parameters are a sequence of per-layer dicts with identical shapes, so one compiled
per-layer function serves every layer, and each layer's weights are their own buffers: slicing
a layer out of stacked arrays costs XLA a copy (measured on the H200: 1.09 ms vs 0.74 ms per
8-layer bf16 decode step for the dense part; benchmarks/README.md). Whole-model functions unroll
the layers. Expert weights arrive separately as an `ExpertPool` plus a `[layers, experts]` slot
table.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from strata_jax.config import ModelConfig
from strata_jax.int4_kernel import Int4Tiles
from strata_jax.layers import apply_rope, attend, einsum_f32, rms_norm, rope_tables
from strata_jax.moe import (
    ExpertPool,
    Routing,
    apply_experts,
    combine_routed,
    route,
    routed_outputs,
)

Params = dict[str, Any]


class KVCache(NamedTuple):
    """Keys and values: one [batch, max_len, kv_heads, head_dim] array per layer.

    Per-layer buffers (not one stacked array) so a decode step updates each in place.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return KVCache(zeros, tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))


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


def _project_qkv(cfg: ModelConfig, lp: Params, h: jax.Array, positions: jax.Array):
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
    return x + _with_shared(cfg, lp, h, out).reshape(x.shape), routing.experts


def moe_pass(
    cfg: ModelConfig, lp: Params, x: jax.Array, pool: ExpertPool, slot_row: jax.Array,
    take: jax.Array, picks: jax.Array, row_chunks: bool | None = None,
    int4_tiles: Int4Tiles | None = None,
) -> jax.Array:
    """`picks` [N, K, D] float32 with the outputs of the experts marked in `take` filled in:
    moe_block in several passes when one layer's experts do not fit the pool at once."""
    h, routing = route_layer(cfg, lp, x)
    out = routed_outputs(h, routing, pool, slot_row, take, row_chunks, int4_tiles)
    return jnp.where(take[routing.experts][..., None], out, picks)


def moe_finish(cfg: ModelConfig, lp: Params, x: jax.Array, picks: jax.Array) -> jax.Array:
    """The residual MoE output from the picks that the passes filled."""
    h, routing = route_layer(cfg, lp, x)
    out = combine_routed(routing, picks).astype(h.dtype)
    return x + _with_shared(cfg, lp, h, out).reshape(x.shape)


def _with_shared(cfg: ModelConfig, lp: Params, h: jax.Array, out: jax.Array) -> jax.Array:
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


def _causal_layer(cfg, lp, x, positions, pool, slot_row):
    """One layer over a whole (prefix) sequence; also returns its k, v for a cache."""
    x, k, v = causal_attention(cfg, lp, x, positions)
    x, experts = moe_block(cfg, lp, x, pool, slot_row)
    return x, (k, v), experts


def causal_attention(cfg, lp, x, positions):
    """The attention half of a layer over a whole prefix (residual included), with its k, v."""
    o, k, v = attention_heads(cfg, lp, x, positions)
    return x + linear(o, lp, "wo"), k, v


def attention_heads(cfg, lp, x, positions):
    """Causal attention of a whole prefix before wo: (wo's input [B, T, Q], k, v)."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
    q, k, v = _project_qkv(cfg, lp, h, positions)
    t = x.shape[1]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), jnp.bool_)), (x.shape[0], t, t))
    return attend(q, k, v, mask), k, v


def _run_causal(cfg, params, pool, slot_table, tokens):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = params["embed"][tokens]
    kvs, routes = [], []
    for i, lp in enumerate(params["layers"]):
        x, kv, experts = _causal_layer(cfg, lp, x, positions, pool, slot_table[i])
        kvs.append(kv)
        routes.append(experts)
    return lm_head(cfg, params, x), kvs, jnp.stack(routes)


def forward(
    cfg: ModelConfig, params: Params, pool: ExpertPool, slot_table: jax.Array, tokens: jax.Array
) -> jax.Array:
    """Full causal forward of int32 tokens [B, T] -> float32 logits [B, T, vocab]."""
    return _run_causal(cfg, params, pool, slot_table, tokens)[0]


def forward_with_routing(
    cfg: ModelConfig, params: Params, pool: ExpertPool, slot_table: jax.Array, tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Logits plus every layer's selected experts [layers, B * T, top_k]."""
    logits, _, routes = _run_causal(cfg, params, pool, slot_table, tokens)
    return logits, routes


def prefill(
    cfg: ModelConfig,
    params: Params,
    pool: ExpertPool,
    slot_table: jax.Array,
    tokens: jax.Array,
    max_len: int,
) -> tuple[jax.Array, KVCache]:
    """Prefill right-padded prompts [B, T] into a fresh cache of `max_len` positions.

    Returns logits for every position [B, T, vocab]; a row of length n reads position n - 1.
    Cache entries past a row's length hold padding and are overwritten by later decode steps.
    """
    logits, kvs, _ = _run_causal(cfg, params, pool, slot_table, tokens)
    empty = init_cache(cfg, tokens.shape[0], max_len)

    def place(buf, new):
        return jax.lax.dynamic_update_slice_in_dim(buf, new, 0, axis=1)

    k = tuple(place(buf, kv[0]) for buf, kv in zip(empty.k, kvs, strict=True))
    v = tuple(place(buf, kv[1]) for buf, kv in zip(empty.v, kvs, strict=True))
    return logits, KVCache(k, v)


def decode_layer(cfg, lp, x, positions, k_cache, v_cache, pool, slot_row):
    """One layer for one new token per row; k/v caches are this layer's [B, max_len, Hkv, hd]."""
    x, k_cache, v_cache = decode_attention(cfg, lp, x, positions, k_cache, v_cache)
    x, _ = moe_block(cfg, lp, x, pool, slot_row)
    return x, (k_cache, v_cache)


def decode_attention(cfg, lp, x, positions, k_cache, v_cache):
    """The attention half of a decode layer (residual included); writes this step's k, v."""
    b = x.shape[0]
    h = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
    q, k, v = _project_qkv(cfg, lp, h, positions[:, None])
    rows = jnp.arange(b)
    k_cache = k_cache.at[rows, positions].set(k[:, 0])
    v_cache = v_cache.at[rows, positions].set(v[:, 0])
    mask = (jnp.arange(k_cache.shape[1])[None, :] <= positions[:, None])[:, None, :]
    x = x + linear(attend(q, k_cache, v_cache, mask), lp, "wo")
    return x, k_cache, v_cache


def decode_step(
    cfg: ModelConfig,
    params: Params,
    pool: ExpertPool,
    slot_table: jax.Array,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, KVCache]:
    """One token per row: tokens [B] placed at positions [B] -> logits [B, vocab], new cache."""
    x = params["embed"][tokens][:, None, :]
    ks, vs = [], []
    for i, lp in enumerate(params["layers"]):
        x, (k, v) = decode_layer(cfg, lp, x, positions, cache.k[i], cache.v[i], pool, slot_table[i])
        ks.append(k)
        vs.append(v)
    return lm_head(cfg, params, x[:, 0]), KVCache(tuple(ks), tuple(vs))
