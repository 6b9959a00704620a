"""Mixture-of-experts math: routing, and expert FFNs computed from a pool of slots.

Expert weights are operands (docs/design.md, "Seams"): `apply_experts` takes the pool arrays and the
slot where each of the layer's experts sits, so one compiled function serves a fully resident
model, a cache of hot experts, or a staging buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from strata_jax.ops import expert_kernels
from strata_jax.ops.expert_kernels import SWIGLU, Glu
from strata_jax.ops.int4_kernel import Int4Tiles
from strata_jax.ops.layers import ordered_sum
from strata_jax.ops.pool import ExpertPool


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
        weights = weights / ordered_sum(weights, -1, keepdims=True)
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
    row_chunks: bool | None = None,
    int4_tiles: Int4Tiles | None = None,
    glu: Glu = SWIGLU,
) -> jax.Array:
    """Weighted sum of the selected experts' SwiGLU outputs, reading each active expert once.

    x [N, D]; slot_of_expert [E] int32 maps this layer's expert ids to pool slots. The same
    arithmetic as `routed_outputs` + `combine_routed` in one pass, so a layer computed in
    several passes (the offload runtime's staging) gives the same bits.
    """
    take = jnp.ones(slot_of_expert.shape, jnp.bool_)
    picks = routed_outputs(x, routing, pool, slot_of_expert, take, row_chunks, int4_tiles, glu)
    return combine_routed(routing, picks).astype(x.dtype)


def routed_outputs(
    x: jax.Array,
    routing: Routing,
    pool: ExpertPool,
    slot_of_expert: jax.Array,
    take: jax.Array,
    row_chunks: bool | None = None,
    int4_tiles: Int4Tiles | None = None,
    glu: Glu = SWIGLU,
) -> jax.Array:
    """Each pick's expert output [N, K, D] float32, for the experts marked in `take` [E] (bool);
    other picks are zero.

    Where no Pallas kernel takes the shape (the CPU; prefill-sized N on the GPU), the picks
    are sorted by expert and each taken expert multiplies its own rows (`_sorted_outputs`), so
    the work follows the picks, not N x experts.
    One layer's experts may then be computed in several passes over different pool contents
    and merged exactly (each pick is filled by exactly one pass): every expert's output comes
    from the same compiled code whatever else shares its pass. `row_chunks` (default: what
    the kernels' choice) has each Pallas call multiply only the rows routed to its expert;
    `int4_tiles` (default `int4_kernel.int4_tiles_for`) tiles the Mosaic int4 kernel, where it runs.
    Biased experts and another `glu` (GPT-OSS) take the sorted XLA path: no kernel knows them.
    """
    n, d = x.shape
    if row_chunks is None and not (
            expert_kernels.plain(pool, glu) and expert_kernels.use_pallas(
                n, d, pool.intermediate_size, pool.quantized, x.dtype)):
        outputs = _sorted_outputs
    elif row_chunks is None:
        outputs = _chunked_outputs if n > expert_kernels.ROW_TILE else _dense_outputs
    else:
        outputs = _chunked_outputs if row_chunks else _dense_outputs
    picked = outputs(x, routing, pool, slot_of_expert, take, int4_tiles, glu)
    return jnp.where(take[routing.experts][..., None], picked, 0.0)


def _dense_outputs(x, routing, pool, slot_of_expert, take, int4_tiles, glu=SWIGLU):
    """Every active expert applied to all N rows; picks read out of [C, N, D]."""
    n, num_experts = x.shape[0], slot_of_expert.shape[0]
    capacity = expert_capacity(n, routing.experts.shape[-1], num_experts)
    ids, valid = active_experts(routing.experts, num_experts, capacity, take)
    outputs = expert_kernels.grouped_swiglu(x, slot_of_expert[ids], pool, valid, int4_tiles,
                                            glu)
    per_expert = ordered_sum(outputs, 1)
    position = jnp.argmax(routing.experts[:, :, None] == ids[None, None, :], axis=-1)
    return per_expert[position, jnp.arange(n)[:, None]]


def _chunked_outputs(x, routing, pool, slot_of_expert, take, int4_tiles, glu=SWIGLU):
    """Each expert applied to its own rows only, in chunks of ROW_TILE rows."""
    chunks = chunk_picks(routing.experts, take, slot_of_expert.shape[0],
                        expert_kernels.ROW_TILE)
    rows = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[chunks.rows]
    slots = slot_of_expert[jnp.minimum(chunks.expert, slot_of_expert.shape[0] - 1)]
    outputs = ordered_sum(
        expert_kernels.grouped_swiglu(rows, slots, pool, chunks.valid, int4_tiles, glu), 1)
    return outputs[chunks.pick_chunk, chunks.pick_row]


SORTED_ROWS = 128
"""Rows of each dot of `_sorted_outputs`: one shape for every program, so a pick's bits do not
depend on the other rows of its tile or on how many tokens the program has (a prefill chunk,
a decode step, a row riding along); large enough that a tile's dot is not bound by reading
the expert's weights again."""


def _sorted_outputs(x, routing, pool, slot_of_expert, take, int4_tiles=None, glu=SWIGLU):
    """Picks sorted by expert (token order within one); each taken expert's weights
    dequantized once, then its rows multiplied SORTED_ROWS at a time in a loop as long as its
    pick count (docs/design.md, "Prefill"). Experts not taken or not picked cost nothing."""
    n, k = routing.experts.shape
    e, d = slot_of_expert.shape[0], x.shape[1]
    slot_of_expert, flat = jnp.asarray(slot_of_expert), jnp.asarray(routing.experts).reshape(-1)
    pool = jax.tree.map(jnp.asarray, pool)  # indexed by traced slots in the loop
    key = jnp.where(take[flat], flat, e)
    order = jnp.argsort(key, stable=True)
    counts = jnp.bincount(key, length=e + 1)[:e]
    starts = jnp.cumsum(counts) - counts
    r = SORTED_ROWS
    rows = jnp.concatenate([x[order // k], jnp.zeros((r, d), x.dtype)])

    def expert(i, out):
        def run(out):
            slot = slot_of_expert[i][None]
            w1, w3, w2 = jax.lax.optimization_barrier(  # dequantized once, not per tile
                tuple(pool.dense_weights(kind, slot, x.dtype)[0] for kind in ("w1", "w3", "w2")))
            biases = pool.biases(slot, x.dtype)
            biases = None if biases is None else tuple(b[0] for b in biases)

            def tile(t, out):
                at = starts[i] + t * r
                y = expert_kernels.swiglu_xla(jax.lax.dynamic_slice_in_dim(rows, at, r),
                                              w1, w3, w2, biases, glu)
                mine = (t * r + jnp.arange(r)) < counts[i]  # the rest: the next experts'
                old = jax.lax.dynamic_slice_in_dim(out, at, r)
                return jax.lax.dynamic_update_slice_in_dim(
                    out, jnp.where(mine[:, None], y, old), at, 0)

            return jax.lax.fori_loop(0, -(-counts[i] // r), tile, out)

        return jax.lax.cond(counts[i] > 0, run, lambda out: out, out)

    out = jax.lax.fori_loop(0, e, expert, jnp.zeros((n * k + r, d), jnp.float32))
    picked = jnp.zeros((n * k, d), jnp.float32).at[order].set(out[:n * k])
    return picked.reshape(n, k, d)


class RowChunks(NamedTuple):
    """Picks grouped by expert into chunks of R rows (fixed shapes).

    expert [C] (E marks an unused chunk), valid [C], rows [C, R] token of each row (N marks
    padding), and for every pick [N, K] its chunk and row (0 for picks not taken)."""

    expert: jax.Array
    valid: jax.Array
    rows: jax.Array
    pick_chunk: jax.Array
    pick_row: jax.Array


def chunk_capacity(num_tokens: int, top_k: int, num_experts: int, rows: int) -> int:
    """Most chunks the picks can need: one per active expert plus the overflow of full ones."""
    return expert_capacity(num_tokens, top_k, num_experts) + -(-num_tokens * top_k // rows)


def chunk_picks(experts: jax.Array, take: jax.Array, num_experts: int, rows: int) -> RowChunks:
    """Group the picks `experts` [N, K] of the experts marked in `take` [E] by expert id (token
    order within an expert) into chunks of `rows` rows."""
    n, k = experts.shape
    capacity = chunk_capacity(n, k, num_experts, rows)
    flat = experts.reshape(-1)
    key = jnp.where(take[flat], flat, num_experts)  # picks not taken sort last
    order = jnp.argsort(key, stable=True)
    counts = jnp.bincount(key, length=num_experts + 1)[:num_experts]
    first_pick = jnp.cumsum(counts) - counts
    first_chunk = jnp.cumsum(-(-counts // rows)) - (-(-counts // rows))
    sorted_key = key[order]
    expert = jnp.minimum(sorted_key, num_experts - 1)
    rank = jnp.arange(n * k) - first_pick[expert]
    taken = sorted_key < num_experts
    chunk = jnp.where(taken, first_chunk[expert] + rank // rows, capacity)
    row = rank % rows
    token = order // k
    table = jnp.full((capacity + 1, rows), n, jnp.int32).at[chunk, row].set(token)
    owner = jnp.full((capacity + 1,), num_experts, jnp.int32).at[chunk].set(sorted_key)
    pick_chunk = jnp.zeros(n * k, jnp.int32).at[order].set(jnp.where(taken, chunk, 0))
    pick_row = jnp.zeros(n * k, jnp.int32).at[order].set(jnp.where(taken, row, 0))
    return RowChunks(owner[:capacity], owner[:capacity] < num_experts, table[:capacity],
                     pick_chunk.reshape(n, k), pick_row.reshape(n, k))


def combine_routed(routing: Routing, outputs: jax.Array) -> jax.Array:
    """The routing-weighted sum over picks of `routed_outputs` [N, K, D] -> [N, D] float32."""
    weights = routing.weights.astype(jnp.float32)[..., None]
    return ordered_sum(outputs * weights, 1)
