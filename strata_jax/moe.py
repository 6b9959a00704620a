"""Mixture-of-experts math: routing, and expert FFNs computed from a pool of slots.

Expert weights are operands (DESIGN.md seam 2): `apply_experts` takes the pool arrays and the
slot where each of the layer's experts sits, so one compiled function serves a fully resident
model, a cache of hot experts, or a staging buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from strata_jax import expert_kernels
from strata_jax.pool import ExpertPool


class Routing(NamedTuple):
    """Top-k routing of N tokens: expert ids and combine weights [N, k], raw logits [N, E]."""

    experts: jax.Array
    weights: jax.Array
    logits: jax.Array


def route(
    h: jax.Array,
    router_w: jax.Array,
    top_k: int,
    norm_topk_prob: bool,
    router_b: jax.Array | None = None,
) -> Routing:
    """Softmax-then-top-k routing shared by Mixtral, Qwen-MoE and OLMoE.

    h [N, D], router_w [D, E]. Mixtral always renormalizes the top-k probabilities; the Qwen
    and OLMoE families do so when `norm_topk_prob` is set.
    """
    logits = (h @ router_w).astype(jnp.float32)
    if router_b is not None:
        logits = logits + router_b.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), weights.astype(h.dtype), logits)


def active_experts(
    experts: jax.Array, num_experts: int, capacity: int, take: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The distinct experts named in `experts` (those marked in `take` [E], if given), in id
    order, padded to `capacity`.

    Returns (ids [C], valid [C]); padding entries name absent experts and are marked invalid.
    """
    present = jnp.zeros((num_experts,), jnp.bool_).at[experts.reshape(-1)].set(True)
    if take is not None:
        present = present & take
    order = jnp.argsort(~present, stable=True)[:capacity].astype(jnp.int32)
    return order, present[order]


def expert_capacity(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Most distinct experts that `num_tokens` tokens can select."""
    return min(num_experts, num_tokens * top_k)


def apply_experts(
    x: jax.Array,
    routing: Routing,
    pool: ExpertPool,
    slot_of_expert: jax.Array,
) -> jax.Array:
    """Weighted sum of the selected experts' SwiGLU outputs, reading each active expert once.

    x [N, D]; slot_of_expert [E] int32 maps this layer's expert ids to pool slots. The same
    arithmetic as `routed_outputs` + `combine_routed` in one pass, so a layer computed in
    several passes (the offload runtime's staging) gives the same bits.
    """
    take = jnp.ones(slot_of_expert.shape, jnp.bool_)
    picks = routed_outputs(x, routing, pool, slot_of_expert, take)
    return combine_routed(routing, picks).astype(x.dtype)


def routed_outputs(
    x: jax.Array,
    routing: Routing,
    pool: ExpertPool,
    slot_of_expert: jax.Array,
    take: jax.Array,
) -> jax.Array:
    """Each pick's expert output [N, K, D] float32, for the experts marked in `take` [E] (bool);
    other picks are zero.

    One layer's experts may then be computed in several passes over different pool contents
    and merged exactly (each pick is filled by exactly one pass): every expert's output comes
    from the same compiled code whatever else shares its pass.
    """
    n, num_experts = x.shape[0], slot_of_expert.shape[0]
    capacity = expert_capacity(n, routing.experts.shape[-1], num_experts)
    ids, valid = active_experts(routing.experts, num_experts, capacity, take)
    outputs = expert_kernels.grouped_swiglu(x, slot_of_expert[ids], pool, valid)
    per_expert = jnp.sum(outputs, axis=1)
    position = jnp.argmax(routing.experts[:, :, None] == ids[None, None, :], axis=-1)
    picked = per_expert[position, jnp.arange(n)[:, None]]
    return jnp.where(take[routing.experts][..., None], picked, 0.0)


def combine_routed(routing: Routing, outputs: jax.Array) -> jax.Array:
    """The routing-weighted sum over picks of `routed_outputs` [N, K, D] -> [N, D] float32."""
    weights = routing.weights.astype(jnp.float32)[..., None]
    return jnp.sum(outputs * weights, axis=1)
