"""The MoE decoder's building blocks: attention, routing, the MoE block, the LM head.

Pure functions of one layer's dense params (`lp`, one layer's slice of the params the Flax
module scans) and the residual stream. `flax_model.DecoderLayer` composes them into a layer
of the one compiled step (docs/design.md, "The step"); the quantizer calls them layer by
layer. Expert weights arrive apart, as an `ExpertPool` plus the slot of each of the layer's
experts (docs/design.md, "Seams"); in the step, the misses among them are copied in from the
pinned-host tier (the "experts from the tiers" section).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.formats.config import ModelConfig
from strata_jax.model import misses
from strata_jax.model.moe import (
    ExpertPool,
    Routing,
    apply_experts,
    combine_routed,
    route,
    routed_outputs,
)
from strata_jax.model.routing import (
    SigmoidRouting,
    route_sigmoid,
    route_topk_softmax,
    sigmoid_weights,
    topk_softmax_weights,
)
from strata_jax.ops import expert_kernels
from strata_jax.ops.expert_kernels import Glu
from strata_jax.ops.int4_kernel import Int4Tiles
from strata_jax.ops.int8_kernel import int8_linear
from strata_jax.ops.layers import (
    NEG_INF,
    apply_rope,
    attend,
    einsum_f32,
    ordered_sum,
    rms_norm,
    rope_tables,
    yarn_mscale,
)
from strata_jax.ops.mla_kernel import mla_decode, use_mla_kernel

if TYPE_CHECKING:
    from strata_jax.step.plan import StepPlan

Params = dict[str, Any]


def resident_slot_table(cfg: ModelConfig) -> jax.Array:
    """Slot table of a fully resident pool laid out [layer * num_experts + expert]."""
    ids = jnp.arange(cfg.num_layers * cfg.num_experts, dtype=jnp.int32)
    return ids.reshape(cfg.num_layers, cfg.num_experts)


def linear(x: jax.Array, lp: Params, name: str, plus: jax.Array | None = None,
           bias: jax.Array | None = None) -> jax.Array:
    """x @ lp[name] (+ `plus`: a residual or a bias; + `bias`: a bias besides a residual); an
    int8 matrix carries a per-output-channel scale applied after the dot
    (`int8_kernel.int8_linear`: a kernel that dequantizes in registers at decode rows). A
    float matrix's dot and what is added are summed in float32 and rounded once: XLA may fold
    an add into the GEMM (rounding once) in one program and not in another, so rounding twice
    would make the bits depend on the fusion (docs/design.md, "The step")."""
    if bias is not None and plus is None:
        plus, bias = bias, None
    w = lp[name]
    scale = lp.get(f"{name}_scale")
    if scale is not None:  # the scale's multiply keeps any add out of the GEMM
        y = int8_linear(x, w, scale)
        if bias is not None:
            y = y + bias
        return y if plus is None else plus + y
    if plus is None:
        return x @ w
    y = einsum_f32("...i,io->...o", x, w) + plus.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(jnp.result_type(x.dtype, plus.dtype))


def project_qkv(cfg: ModelConfig, lp: Params, h: jax.Array, positions: jax.Array):
    """q [B,T,Hq,hd], k/v [B,T,Hkv,hd] with the family's q/k norm and RoPE applied."""
    b, t, _ = h.shape
    qkv = linear(h, lp, "wqkv", lp["bqkv"] if cfg.attention_bias else None)
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
    cos, sin = rope_tables(positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def project_mla(cfg: ModelConfig, lp: Params, h: jax.Array, positions: jax.Array):
    """Multi-head latent attention's projections: ((q_nope [B,T,H,dn], q_rope [B,T,H,dr]),
    latent [B,T,1,r] (normed), rope key [B,T,1,dr]), rope applied; the latent and the rope
    key are what the cache keeps (`ModelConfig.cache_shapes`)."""
    b, t, _ = h.shape
    if cfg.q_lora_rank:
        q = linear(rms_norm(linear(h, lp, "wq_a"), lp["q_a_norm"], cfg.rms_eps), lp, "wq_b")
    else:
        q = linear(h, lp, "wq")
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    q_nope, q_rope = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
    kv = linear(h, lp, "wkv_a")
    latent = rms_norm(kv[..., :cfg.kv_lora_rank], lp["kv_a_norm"], cfg.rms_eps)
    cos, sin = rope_tables(positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    q_rope = apply_rope(q_rope, cos, sin, cfg.rope_interleave)
    k_rope = apply_rope(kv[..., None, cfg.kv_lora_rank:], cos, sin, cfg.rope_interleave)
    return (q_nope, q_rope), latent[:, :, None], k_rope


def mla_scale(cfg: ModelConfig) -> float:
    """MLA's softmax scale: 1 / sqrt(q's head dim), times YaRN's mscale squared where the
    rope is scaled with `mscale_all_dim` (transformers' `yarn_apply_mscale`)."""
    scale = cfg.head_dim ** -0.5
    p = dict(cfg.rope_scaling or ())
    if p.get("mscale_all_dim"):
        scale *= yarn_mscale(float(p["factor"]), p["mscale_all_dim"]) ** 2
    return scale


def attend_mla(cfg: ModelConfig, lp: Params, q, latent: jax.Array, k_rope: jax.Array,
               mask: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
    """Attention over the latent cache with the up-projections absorbed (docs/design.md,
    "MLA"): q_nope through W_uk scores the latent [B,S,1,r] directly, and the latent that the
    probabilities mix goes through W_uv once per query, so no per-head key or value is ever
    made. Returns [B, T, H * v_head_dim]. `lengths` [B] (one token a row, the mask's
    `arange(S) < lengths`): the fused decode kernel where it runs (`mla_kernel`: the latent
    read once)."""
    q_nope, q_rope = q
    b, t, heads, _ = q_nope.shape
    r, dn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    wkv_b = lp["wkv_b"].reshape(r, heads, dn + cfg.v_head_dim)
    q_lat = einsum_f32("bthn,rhn->bthr", q_nope, wkv_b[..., :dn]).astype(latent.dtype)
    if lengths is not None and use_mla_kernel(b, heads, r, k_rope.shape[-1], latent.shape[1],
                                              latent.dtype):
        mixed = mla_decode(q_lat[:, 0], q_rope[:, 0], latent[:, :, 0], k_rope[:, :, 0],
                           lengths, mla_scale(cfg))[:, None].astype(latent.dtype)
        out = jnp.einsum("bthr,rhv->bthv", mixed, wkv_b[..., dn:])
        return out.reshape(b, t, heads * cfg.v_head_dim)
    scores = (einsum_f32("bthr,bsr->bhts", q_lat, latent[:, :, 0])
              + einsum_f32("bthd,bsd->bhts", q_rope, k_rope[:, :, 0]))
    scores = jnp.where(mask[:, None], scores * mla_scale(cfg), NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(latent.dtype)
    mixed = jnp.einsum("bhts,bsr->bthr", probs, latent[:, :, 0])
    out = jnp.einsum("bthr,rhv->bthv", mixed, wkv_b[..., dn:])
    return out.reshape(b, t, heads * cfg.v_head_dim)


def project(cfg: ModelConfig, lp: Params, h: jax.Array, positions: jax.Array):
    """(q, what the cache's first array keeps, its second) of the family's attention."""
    if cfg.attention == "mla":
        return project_mla(cfg, lp, h, positions)
    return project_qkv(cfg, lp, h, positions)


def attend_cached(cfg: ModelConfig, lp: Params, q, k: jax.Array, v: jax.Array,
                  mask: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
    """The family's attention of q over the cache arrays k, v [B, S, ...] (before wo);
    `lengths`: see `attend_mla`."""
    if cfg.attention == "mla":
        return attend_mla(cfg, lp, q, k, v, mask, lengths)
    return attend(q, k, v, mask, lp["sinks"] if cfg.attention_sinks else None)


def attention_mask(cfg: ModelConfig, positions: jax.Array, length: int,
                   layer: jax.Array | int) -> jax.Array:
    """[B, T, length] bool: the cache positions each query at `positions` [B, T] sees: every
    one up to its own, and in a sliding layer (`ModelConfig.sliding_layers`; `layer` over
    `total_layers`) only the last `sliding_window` of them, as transformers masks them."""
    seen = jnp.arange(length)[None, None, :]
    at = positions[:, :, None]
    mask = seen <= at
    windows = cfg.layer_windows()
    if windows is None:
        return mask
    window = jnp.asarray(windows, jnp.int32)[layer]
    return mask & ((window == 0) | (seen > at - window))


def out_projection(cfg: ModelConfig, lp: Params, o: jax.Array, x: jax.Array) -> jax.Array:
    """x + o @ wo (+ GPT-OSS's `bo`), summed in float32 and rounded once (`linear`)."""
    return linear(o, lp, "wo", x, lp["bo"] if cfg.o_bias else None)


def route_layer(cfg: ModelConfig, lp: Params, x: jax.Array) -> tuple[jax.Array, Routing]:
    """The MoE input [N, D] of residual stream x and its routing (what moe_block will use)."""
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_eps).reshape(-1, x.shape[-1])
    if cfg.scoring == "sigmoid":
        logits = (h @ lp["router"]).astype(jnp.float32)
        if "router_bias" in lp:  # a synthetic model's skew (`ModelConfig.router_bias`)
            logits = logits + lp["router_bias"].astype(jnp.float32)
        experts, weights = route_sigmoid(logits, lp["router_correction"],
                                         SigmoidRouting.of(cfg))
        return h, Routing(experts, weights, logits)
    if cfg.scoring == "topk_softmax":  # GPT-OSS: the router's bias is learned
        logits = linear(h, lp, "router", lp["router_bias"]).astype(jnp.float32)
        experts, weights = route_topk_softmax(logits, cfg.top_k)
        return h, Routing(experts, weights.astype(h.dtype), logits)
    return h, route(h, lp["router"], cfg.top_k, cfg.norm_topk_prob, lp.get("router_bias"))


def force_routing(cfg: ModelConfig, routing: Routing, forced: jax.Array) -> Routing:
    """`routing` with the experts of `forced` [N, k] (-1: the router's own pick) and the
    router's weights at them, normalized as the router does: a routing trace replayed
    (docs/design.md, "The routing trace"). Forcing the ids the router picked gives its
    weights bit for bit."""
    experts = jnp.where(forced >= 0, forced, routing.experts)
    if cfg.scoring == "sigmoid":
        weights = sigmoid_weights(routing.logits, experts, SigmoidRouting.of(cfg))
        return Routing(experts, weights, routing.logits)
    if cfg.scoring == "topk_softmax":
        weights = topk_softmax_weights(routing.logits, experts)
        return Routing(experts, weights.astype(routing.weights.dtype), routing.logits)
    weights = jnp.take_along_axis(jax.nn.softmax(routing.logits, axis=-1), experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / ordered_sum(weights, -1, keepdims=True)
    return Routing(experts, weights.astype(routing.weights.dtype), routing.logits)


def dense_mlp(lp: Params, h: jax.Array, x: jax.Array) -> jax.Array:
    """x plus the SwiGLU MLP of h (x normed) of a dense-MLP layer (`ModelConfig.dense_layers`)."""
    gate, up = linear(h, lp, "ffn_w1"), linear(h, lp, "ffn_w3")
    return linear(jax.nn.silu(gate) * up, lp, "ffn_w2", x)


def moe_block(
    cfg: ModelConfig, lp: Params, x: jax.Array, pool: ExpertPool, slot_row: jax.Array,
    row_chunks: bool | None = None, int4_tiles: Int4Tiles | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Residual MoE FFN (routed + optional gated shared expert); also the selected experts.
    `row_chunks`, `int4_tiles`: see `moe.routed_outputs`."""
    check_pool(cfg, pool)
    h, routing = route_layer(cfg, lp, x)
    out = apply_experts(h, routing, pool, slot_row, row_chunks, int4_tiles, Glu.of(cfg))
    return x + with_shared(cfg, lp, h, out).reshape(x.shape), routing.experts


def check_pool(cfg: ModelConfig, pool: ExpertPool) -> None:
    """ValueError unless `pool` holds what `cfg`'s experts need: their biases exactly where
    the model has them (a pool without them would compute other experts, silently)."""
    if cfg.expert_bias != pool.biased:
        have = "carries" if pool.biased else "lacks"
        raise ValueError(
            f"{cfg.family}: the expert pool {have} expert biases (b1, b3, b2) but "
            f"ModelConfig.expert_bias={cfg.expert_bias}: a checkpoint of another model?")


def with_shared(cfg: ModelConfig, lp: Params, h: jax.Array, out: jax.Array) -> jax.Array:
    """Add the (optionally gated) shared expert's output to the routed experts' `out`."""
    if not cfg.has_shared_expert:
        return out
    gate, up = linear(h, lp, "shared_w1"), linear(h, lp, "shared_w3")
    if not cfg.shared_gate:
        return linear(jax.nn.silu(gate) * up, lp, "shared_w2", out)
    shared = linear(jax.nn.silu(gate) * up, lp, "shared_w2")
    return out + jax.nn.sigmoid(h @ lp["shared_gate"][:, None]) * shared


def lm_head(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    h = rms_norm(x, params["final_norm"], cfg.rms_eps)
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return einsum_f32("...d,vd->...v", h, w)


def causal_attention(cfg, lp, x, positions, layer=None):
    """The attention half of a layer over a whole prefix (residual included), with its k, v
    (MLA: the latent and the rope key); `layer`: see `attention_heads`."""
    o, k, v = attention_heads(cfg, lp, x, positions, layer)
    return out_projection(cfg, lp, o, x), k, v


def attention_heads(cfg, lp, x, positions, layer=None):
    """Causal attention of a whole prefix before wo: (wo's input [B, T, Q], k, v). `layer`:
    the decoder layer (over `total_layers`), which a model with sliding layers needs."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
    q, k, v = project(cfg, lp, h, positions)
    t = x.shape[1]
    if cfg.layer_windows() is None:
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), jnp.bool_)), (x.shape[0], t, t))
    elif layer is None:
        raise ValueError(f"{cfg.family}: layers {cfg.sliding_layers} attend over a sliding "
                         "window; attention_heads needs the layer")
    else:
        mask = attention_mask(cfg, positions, t, layer)
    return gate_heads(cfg, lp, h, attend_cached(cfg, lp, q, k, v, mask)), k, v


def gate_heads(cfg: ModelConfig, lp: Params, h: jax.Array, o: jax.Array) -> jax.Array:
    """The attention output o [B, T, Q] times sigmoid(h @ wgate) (Qwen3-Next's output gate,
    `ModelConfig.attention_gate`; h: the layer's normed input), in float32, rounded once."""
    if not cfg.attention_gate:
        return o
    gate = jax.nn.sigmoid(linear(h, lp, "wgate").astype(jnp.float32))
    return (o.astype(jnp.float32) * gate).astype(o.dtype)


def fuse_qkv(lp: Params) -> Params:
    """Replace wq/wk/wv (and biases) by one [D, Q + 2 KV] matrix: one GEMV instead of three.
    Works on numpy arrays, jax arrays and `jax.ShapeDtypeStruct`s (under `jax.eval_shape`).
    MLA's projections (no wk, wv) stay as they are."""
    lp = dict(lp)
    cat = np.concatenate if all(isinstance(lp[k], np.ndarray) for k in ("wq", "wk", "wv")
                                if k in lp) else jnp.concatenate
    for suffix in ("", "_scale"):
        if f"wk{suffix}" in lp:
            parts = [lp.pop(f"w{p}{suffix}") for p in "qkv"]
            lp[f"wqkv{suffix}"] = cat(parts, axis=-1)
    if "bq" in lp:
        lp["bqkv"] = cat([lp.pop("bq"), lp.pop("bk"), lp.pop("bv")], axis=-1)
    return lp


def cached_attention(cfg: ModelConfig, lp: Params, x, positions, k_all, v_all, layer, row):
    """Write the chunk's cache entries into the stacked cache (`ModelConfig.cache_shapes`;
    chunk row b into cache row `row[b]`, or row b when `row` is None) at `positions` [B, T]
    (out of range: dropped) and attend over layer `layer`'s cache (a sliding layer over the
    last `sliding_window` positions of it: `attention_mask`); residual included. Returns
    (x, k_all, v_all)."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
    q, k, v = project(cfg, lp, h, positions)
    b, t = positions.shape
    rows = jnp.arange(b) if row is None else row
    rows = jnp.broadcast_to(rows[:, None], (b, t))
    layer_ix = jnp.full((b, t), layer)
    k_all = k_all.at[layer_ix, rows, positions].set(k, mode="drop")
    v_all = v_all.at[layer_ix, rows, positions].set(v, mode="drop")
    if row is None:
        kc, vc = k_all[layer], v_all[layer]
    else:  # a padding row (past the capacity) reads the last row, and its output is dropped
        own = jnp.minimum(row, k_all.shape[1] - 1)
        kc, vc = k_all[layer, own], v_all[layer, own]
    mask = attention_mask(cfg, positions, kc.shape[1], layer)
    lengths = positions[:, 0] + 1 if t == 1 else None  # a decode step (or riders)
    o = gate_heads(cfg, lp, h, attend_cached(cfg, lp, q, kc, vc, mask, lengths))
    return out_projection(cfg, lp, o, x), k_all, v_all


# --- experts from the tiers (docs/design.md, "The step") ---------------------------------------


def _present(experts: jax.Array, token_live: jax.Array, num_experts: int) -> jax.Array:
    """Live tokens routed to each expert [E] int32."""
    live = jnp.broadcast_to(token_live[:, None], experts.shape).astype(jnp.int32)
    return jnp.zeros((num_experts,), jnp.int32).at[experts.reshape(-1)].add(live.reshape(-1))


def _first(mask: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """The ids of the first `count` set entries of `mask` [E] (id order) and which are real."""
    order = jnp.argsort(~mask, stable=True)[:count].astype(jnp.int32)
    return order, mask[order]


def copy_in(pool: ExpertPool, host: ExpertPool, host_slots: jax.Array, first_slot,
             count) -> ExpertPool:
    """Copy host slots `host_slots[:count]` into pool slots first_slot, first_slot + 1, ...
    One dynamic slice of the pinned-host arrays straight into `device_put` per expert: only
    the slice crosses the link (docs/design.md, "Measured"; a gather would be host compute)."""

    def one(j, arrays):
        src = host_slots[j]
        moved = []
        for buf, src_buf in zip(arrays, host, strict=True):
            if buf is None:
                moved.append(None)
                continue
            piece = jax.device_put(src_buf[src], jax.memory.Space.Device)
            moved.append(jax.lax.dynamic_update_index_in_dim(buf, piece, first_slot + j, 0))
        return ExpertPool(*moved)

    return jax.lax.fori_loop(0, count, one, pool)


def _slot_row(ids: jax.Array, real: jax.Array, first_slot, num_experts: int) -> jax.Array:
    """[E] int32: slot first_slot + j for expert ids[j] (real entries), else -1."""
    target = jnp.where(real, ids, num_experts)
    slots = first_slot + jnp.arange(ids.shape[0], dtype=jnp.int32)
    return jnp.full((num_experts,), -1, jnp.int32).at[target].set(slots, mode="drop")


def _own(plan: StepPlan, owner_row: jax.Array | None) -> jax.Array | bool:
    """[E] bool: the experts this device serves, those whose owner (`owner_row`, the layer's
    row of `Tiers.owner`) is its index on the expert axis; True on one device."""
    if plan.expert_axis is None:
        return True
    if owner_row is None:
        raise ValueError("experts over an expert axis need Tiers.owner (expert_parallel.owners)")
    return owner_row == jax.lax.axis_index(plan.expert_axis)


def _resident_experts(plan: StepPlan, h, routing, pool, page_row, glu: Glu):
    """Every pick from its slot; over an expert axis, each device's own experts' picks (the
    others are -1 in its page row), joined by a sum in which each pick has one term."""
    picks = routed_outputs(h, routing, pool, jnp.maximum(page_row, 0), page_row >= 0,
                           plan.row_chunks, plan.int4_tiles, glu)
    if plan.expert_axis is not None:
        picks = jax.lax.psum(picks, plan.expert_axis)
    return combine_routed(routing, picks).astype(h.dtype)


def _offload_picks(plan: StepPlan, h, routing, pool, host, slot_of, missing, host_row, half,
                   glu: Glu, after=None):
    """The layer's picks [N, k, D] float32 in passes: pass p copies the p-th group of
    `staging` misses into staging half `half` and computes them (pass 0 also every expert
    that already has a slot); each pick is filled by exactly one pass, so the sum is the
    resident one bit for bit. Picks of experts in neither are zero. `after`: a value the
    passes wait for (the host's ticket: its work starts before the device's)."""
    m, e = plan.staging, slot_of.shape[0]
    base = pool.num_slots - 2 * m + half * m
    order = jnp.argsort(~missing, stable=True).astype(jnp.int32)
    n = jnp.sum(missing, dtype=jnp.int32)
    padded = jnp.concatenate([order, jnp.full((m,), e, jnp.int32)])
    if after is not None:
        padded, _ = jax.lax.optimization_barrier((padded, after))

    def one_pass(p, carry):
        pool, picks = carry
        ids = jax.lax.dynamic_slice_in_dim(padded, p * m, m)
        real = (p * m + jnp.arange(m)) < n
        count = jnp.clip(n - p * m, 0, m)
        pool = copy_in(pool, host, host_row[jnp.minimum(ids, e - 1)], base, count)
        staged = _slot_row(ids, real, base, e)
        take = (staged >= 0) | ((p == 0) & (slot_of >= 0))
        row = jnp.maximum(jnp.where(staged >= 0, staged, slot_of), 0)
        out = routed_outputs(h, routing, pool, row, take, plan.row_chunks, plan.int4_tiles,
                             glu)
        return pool, jnp.where(take[routing.experts][..., None], out, picks)

    picks = jnp.zeros((*routing.experts.shape, h.shape[-1]), jnp.float32)
    passes = jnp.maximum(1, -(-n // m))
    pool, picks = jax.lax.fori_loop(0, passes, one_pass, (pool, picks))
    return picks, pool, n


def _expert_bytes(pool: ExpertPool) -> int:
    """Bytes of one expert as the pool holds it."""
    return sum(a.size // a.shape[0] * a.dtype.itemsize for a in pool if a is not None)


def prefetch(cfg: ModelConfig, plan: StepPlan, pool, host, x_attn, next_lp, next_page,
             next_host, token_live, half, last):
    """Copy what layer l+1's router (`next_lp`) picks on layer l's stream into half `half`
    (the half layer l+1 reads first): returns the pool and the prefetched ids [staging]
    (-1: none). The last layer (`last`) prefetches nothing."""
    _, guess = route_layer(cfg, next_lp, x_attn)
    wanted = (_present(guess.experts, token_live, cfg.num_experts) > 0) & ~last
    wanted &= (next_page < 0) & (next_host >= 0)
    ids, real = _first(wanted, plan.staging)
    base = pool.num_slots - 2 * plan.staging + half * plan.staging
    count = jnp.sum(real, dtype=jnp.int32)
    pool = copy_in(pool, host, next_host[ids], base, count)
    return pool, jnp.where(real, ids, -1)


def tiered_moe(cfg: ModelConfig, plan: StepPlan, lp: Params, x, pool, host, rows, token_live,
               pre_ids, half, host_work=None, forced=None):
    """Route the layer and compute its experts from wherever they lie. rows = (page,
    host_page, owner) of this layer (owner None on one device); `pre_ids`: the experts
    prefetched into the other half;
    `host_work`: the host kernel's tier and rates (`misses`; plans whose `miss` is not
    "fetch"); `forced` [N, k]: replayed picks (`force_routing`; None: the router's).
    Returns (x, pool, the layer's `step.StepRecord` fields)."""
    page_row, host_row, owner_row = rows
    check_pool(cfg, pool)
    glu = Glu.of(cfg)
    h, routing = route_layer(cfg, lp, x)
    if forced is not None:
        routing = force_routing(cfg, routing, forced)
    counts = _present(routing.experts, token_live, cfg.num_experts)
    present = counts > 0
    hits = jnp.sum(present & (page_row >= 0), dtype=jnp.int32)  # over an axis: its own
    zero = jnp.zeros((), jnp.int32)
    fields = {"counts": counts, "experts": routing.experts, "hits": hits}
    if plan.staging == 0:
        out = _resident_experts(plan, h, routing, pool, page_row, glu)
        fields.update(prefetched=zero, fetched=zero, hosted=zero, issued=zero,
                      disk=jnp.zeros_like(present))
        return x + with_shared(cfg, lp, h, out).reshape(x.shape), pool, fields
    pre_slot = _slot_row(pre_ids, pre_ids >= 0, pool.num_slots - 2 * plan.staging
                         + (1 - half) * plan.staging, cfg.num_experts)
    slot_of = jnp.where(page_row >= 0, page_row, pre_slot)
    mine = present & _own(plan, owner_row)
    missing = mine & (slot_of < 0)
    disk = missing & (host_row < 0)
    prefetched = jnp.sum(mine & (page_row < 0) & (pre_slot >= 0), dtype=jnp.int32)
    if plan.miss != "fetch" and not expert_kernels.plain(pool, glu):
        raise ValueError(f"{cfg.family}: StepPlan.miss={plan.miss!r} computes misses in the host "
                         "kernel, which knows neither expert biases nor another gate yet: use "
                         "miss='fetch'")
    if plan.miss != "fetch" and host_work is None:
        raise ValueError(f"StepPlan.miss={plan.miss!r} needs Tiers.host_work (misses.HostWork: "
                         "the registered tier-1 views and the rates)")
    rates = None if host_work is None else host_work.rates
    hosted = misses.split(plan.miss, counts, missing & ~disk, rates, _expert_bytes(pool))
    ticket = None
    if plan.miss != "fetch":
        ticket = misses.host_submit(host_work, hosted, host_row, h, routing.experts, token_live)
    picks, pool, fetched = _offload_picks(plan, h, routing, pool, host, slot_of,
                                          missing & ~disk & ~hosted, host_row, half, glu,
                                          ticket)
    if ticket is not None:
        picks = misses.host_collect(ticket, hosted, routing.experts, picks)
    issued = jnp.sum(pre_ids >= 0, dtype=jnp.int32)
    if plan.expert_axis is not None:  # each device served its own experts' picks; the
        # counters stay its own (`expert_parallel.programs` gives them per device)
        picks, disk = jax.lax.psum((picks, disk.astype(jnp.int32)), plan.expert_axis)
        disk = disk > 0
    out = combine_routed(routing, picks).astype(h.dtype)
    fields.update(prefetched=prefetched, fetched=fetched,
                  hosted=jnp.sum(hosted, dtype=jnp.int32), issued=issued, disk=disk)
    return x + with_shared(cfg, lp, h, out).reshape(x.shape), pool, fields
