"""The one compiled step: a scan over layers with the experts' misses served inside it.

docs/design.md, "The step". One jitted program runs a decode step (or a prefill chunk) of the
whole model: per layer, attention writes this step's k/v into the stacked cache, the router
picks experts, the device page table says which sit in an HBM slot, the misses are copied
from the stacked pinned-host tier into a staging half of the slot pool by a dynamic slice and
`device_put` (only the slice moves), the experts predicted for the next layer are copied into
the other half, and the expert kernel reads every expert from the one pool by slot. Nothing
is read back to the host inside the program: it returns the new state and a small record of
what each layer routed and moved, which the host reads after the next step is dispatched.

Resident is the case where every expert has a slot: `StepPlan(staging=0)` compiles no miss
handling at all (a data-dependent loop costs a device->host sync of its trip count on GPUs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import chex
import jax
import jax.numpy as jnp

from strata_jax.config import ModelConfig
from strata_jax.int4_kernel import Int4Tiles
from strata_jax.layers import attend, rms_norm
from strata_jax.model import linear, lm_head, project_qkv, route_layer, with_shared
from strata_jax.moe import combine_routed, routed_outputs
from strata_jax.pool import ExpertPool
from strata_jax.sampling import (
    GREEDY,
    SamplerRows,
    greedy_rows,
    mark_seen,
    row_values,
    sample,
    set_row,
)

PREDICTORS = ("none", "next-gate")


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """What is compiled into a step program besides the model's shape."""

    staging: int = 0
    """Experts per staging half. 0: every expert has a slot and no miss handling is compiled.
    Otherwise the last `2 * staging` slots of the pool are the two staging halves."""
    predictor: str = "none"
    """"next-gate": while layer l computes, copy the experts that layer l+1's router picks on
    layer l's post-attention stream into the staging half layer l+1 reads first."""
    row_chunks: bool | None = None
    """Each expert multiplies only its own rows (`moe.routed_outputs`); None = the kernel's
    default for the row count."""
    int4_tiles: Int4Tiles | None = None
    """Tiles of the Mosaic int4 kernel, where it runs (None = tuned per expert shape)."""
    unroll: bool | None = None
    """Unroll the layer scan: no device loop (on a GPU each iteration costs a predicate read)
    and static layer slices instead of a copy of each layer's weights, for a longer compile.
    None: unrolled on GPUs, rolled elsewhere (where the loop is cheap and the compile is
    what costs). Every program compiles without excess precision (`COMPILER_OPTIONS`), so
    rolled and unrolled, resident and offloaded programs give the same bits
    (docs/design.md, "Measured")."""
    sample: bool = False
    """Compile the sampler into decode (`sampling.sample`): rows with a temperature draw,
    the others take the argmax of their penalized logits. False: the plain argmax, for
    batches whose live rows are all greedy (the sort the sampler needs is not free)."""
    def __post_init__(self) -> None:
        if self.unroll is None:  # resolved now: the plan is a static argument, part of the key
            object.__setattr__(self, "unroll", jax.default_backend() == "gpu")
        if self.staging < 0:
            raise ValueError(f"StepPlan.staging must be >= 0, got {self.staging}")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"StepPlan.predictor must be one of {PREDICTORS}, "
                             f"got {self.predictor!r}")


@chex.dataclass(frozen=True)
class Tiers:
    """Where every expert lies besides the device pool (which travels apart, so the staging
    halves can be donated). `page` int32 [L, E]: an expert's pool slot, or -1; `host`: the
    pinned-host tier 1, slots on axis 0 (None when every expert has a device slot);
    `host_page` int32 [L, E]: an expert's host slot, or -1 when it lies only on disk."""

    page: jax.Array
    host: ExpertPool | None
    host_page: jax.Array


@chex.dataclass(frozen=True)
class DecodeState:
    """What a decode step reads and writes, one entry per row of the fixed batch.

    `tokens` [B] int32: each row's last token, placed at `positions` [B] by the next step;
    `k`, `v` [L, B, max_len, kv_heads, head_dim]: the cache; `live` [B] bool: rows in use
    (others compute on padding, route nothing and move nothing); `sampler`: each row's
    sampling settings and the tokens its sequence has seen."""

    tokens: jax.Array
    positions: jax.Array
    k: jax.Array
    v: jax.Array
    live: jax.Array
    sampler: SamplerRows

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


@chex.dataclass(frozen=True)
class StepRecord:
    """Per layer, what a step routed and moved (leading axis: layers).

    `counts` [L, E] int32: live tokens routed to each expert; `experts` [L, N, k] int32 every
    token's picks (N = B for decode); `hits`, `prefetched`, `fetched` [L] int32: distinct
    routed experts served from a tier-0 slot, from the prefetch half, copied on demand;
    `issued` [L] int32 experts prefetched for this layer; `disk` [L, E] bool: routed experts
    found on no faster tier (the step's output is not valid for their rows; docs/design.md,
    "Disk stalls")."""

    counts: jax.Array
    experts: jax.Array
    hits: jax.Array
    prefetched: jax.Array
    fetched: jax.Array
    issued: jax.Array
    disk: jax.Array


@chex.dataclass(frozen=True)
class StepOutput:
    """What a step gives back besides the state it donates and returns: the new tokens
    (`tokens` [B] for decode, the row's next token [] for prefill), their logits float32
    ([B, V]; meaningless for rows not live) and the StepRecord."""

    tokens: jax.Array
    logits: jax.Array
    record: StepRecord


def init_state(cfg: ModelConfig, batch: int, max_len: int,
               device: jax.Device | None = None) -> DecodeState:
    """An empty state of `batch` rows, committed to `device` (default: the first), as the
    step's outputs are: a step then never meets an argument placed otherwise (a recompile)."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    state = DecodeState(tokens=jnp.zeros((batch,), jnp.int32),
                        positions=jnp.zeros((batch,), jnp.int32),
                        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                        live=jnp.zeros((batch,), jnp.bool_),
                        sampler=greedy_rows(batch, cfg.vocab_size))
    return jax.device_put(state, device or jax.devices()[0])


def resident_tiers(page: jax.Array) -> Tiers:
    """Every expert in a device slot: nothing on the host tiers."""
    return Tiers(page=page, host=None, host_page=jnp.full(page.shape, -1, jnp.int32))


# --- attention --------------------------------------------------------------------------------


def _attention(cfg, lp, x, positions, k_all, v_all, layer, row):
    """Write the chunk's k/v into the cache (row `row`, or every row when None) at `positions`
    [B, T] (out of range: dropped) and attend over the cache; residual included."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
    q, k, v = project_qkv(cfg, lp, h, positions)
    b, t = positions.shape
    rows = jnp.arange(b)[:, None] if row is None else jnp.full((b, 1), row)
    rows = jnp.broadcast_to(rows, (b, t))
    layer_ix = jnp.full((b, t), layer)
    k_all = k_all.at[layer_ix, rows, positions].set(k, mode="drop")
    v_all = v_all.at[layer_ix, rows, positions].set(v, mode="drop")
    if row is None:
        kc, vc = k_all[layer], v_all[layer]
    else:
        kc, vc = k_all[layer, row][None], v_all[layer, row][None]
    mask = jnp.arange(kc.shape[1])[None, None, :] <= positions[:, :, None]
    return x + linear(attend(q, kc, vc, mask), lp, "wo"), k_all, v_all


# --- experts ----------------------------------------------------------------------------------


def _present(experts: jax.Array, token_live: jax.Array, num_experts: int) -> jax.Array:
    """Live tokens routed to each expert [E] int32."""
    live = jnp.broadcast_to(token_live[:, None], experts.shape).astype(jnp.int32)
    return jnp.zeros((num_experts,), jnp.int32).at[experts.reshape(-1)].add(live.reshape(-1))


def _first(mask: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """The ids of the first `count` set entries of `mask` [E] (id order) and which are real."""
    order = jnp.argsort(~mask, stable=True)[:count].astype(jnp.int32)
    return order, mask[order]


def _copy_in(pool: ExpertPool, host: ExpertPool, host_slots: jax.Array, first_slot,
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


def _resident_experts(plan, h, routing, pool, page_row):
    picks = routed_outputs(h, routing, pool, page_row, jnp.ones(page_row.shape, jnp.bool_),
                           plan.row_chunks, plan.int4_tiles)
    return combine_routed(routing, picks).astype(h.dtype)


def _offload_experts(plan, h, routing, pool, host, slot_of, missing, host_row, half):
    """The layer's experts in passes: pass p copies the p-th group of `staging` misses into
    staging half `half` and computes them (pass 0 also every expert that already has a slot);
    each pick is filled by exactly one pass, so the sum is the resident one bit for bit."""
    m, e = plan.staging, slot_of.shape[0]
    base = pool.num_slots - 2 * m + half * m
    order = jnp.argsort(~missing, stable=True).astype(jnp.int32)
    n = jnp.sum(missing, dtype=jnp.int32)
    padded = jnp.concatenate([order, jnp.full((m,), e, jnp.int32)])

    def one_pass(p, carry):
        pool, picks = carry
        ids = jax.lax.dynamic_slice_in_dim(padded, p * m, m)
        real = (p * m + jnp.arange(m)) < n
        count = jnp.clip(n - p * m, 0, m)
        pool = _copy_in(pool, host, host_row[jnp.minimum(ids, e - 1)], base, count)
        staged = _slot_row(ids, real, base, e)
        take = (staged >= 0) | ((p == 0) & (slot_of >= 0))
        row = jnp.maximum(jnp.where(staged >= 0, staged, slot_of), 0)
        out = routed_outputs(h, routing, pool, row, take, plan.row_chunks, plan.int4_tiles)
        return pool, jnp.where(take[routing.experts][..., None], out, picks)

    picks = jnp.zeros((*routing.experts.shape, h.shape[-1]), jnp.float32)
    passes = jnp.maximum(1, -(-n // m))
    pool, picks = jax.lax.fori_loop(0, passes, one_pass, (pool, picks))
    return combine_routed(routing, picks).astype(h.dtype), pool, n


def _prefetch(cfg, plan, pool, host, x_attn, next_lp, next_page, next_host, token_live, half,
              last):
    """Copy what layer l+1's router picks on layer l's stream into half `half` (the half
    layer l+1 reads first): returns the pool and the prefetched ids [staging] (-1: none).
    The last layer (`last`) prefetches nothing."""
    _, guess = route_layer(cfg, next_lp, x_attn)
    wanted = (_present(guess.experts, token_live, cfg.num_experts) > 0) & ~last
    wanted &= (next_page < 0) & (next_host >= 0)
    ids, real = _first(wanted, plan.staging)
    base = pool.num_slots - 2 * plan.staging + half * plan.staging
    count = jnp.sum(real, dtype=jnp.int32)
    pool = _copy_in(pool, host, next_host[ids], base, count)
    return pool, jnp.where(real, ids, -1)


def _moe(cfg, plan, lp, x, pool, host, rows, token_live, pre_ids, half):
    """Route layer l and compute its experts from wherever they lie. rows = (page, host_page)
    of this layer. Returns (x, pool, record fields)."""
    page_row, host_row = rows
    h, routing = route_layer(cfg, lp, x)
    counts = _present(routing.experts, token_live, cfg.num_experts)
    present = counts > 0
    hits = jnp.sum(present & (page_row >= 0), dtype=jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    if plan.staging == 0:
        out = _resident_experts(plan, h, routing, pool, page_row)
        fields = (counts, routing.experts, hits, zero, zero, zero, jnp.zeros_like(present))
        return x + with_shared(cfg, lp, h, out).reshape(x.shape), pool, fields
    pre_slot = _slot_row(pre_ids, pre_ids >= 0, pool.num_slots - 2 * plan.staging
                         + (1 - half) * plan.staging, cfg.num_experts)
    slot_of = jnp.where(page_row >= 0, page_row, pre_slot)
    missing = present & (slot_of < 0)
    disk = missing & (host_row < 0)
    prefetched = jnp.sum(present & (page_row < 0) & (pre_slot >= 0), dtype=jnp.int32)
    out, pool, fetched = _offload_experts(plan, h, routing, pool, host, slot_of,
                                          missing & ~disk, host_row, half)
    issued = jnp.sum(pre_ids >= 0, dtype=jnp.int32)
    fields = (counts, routing.experts, hits, prefetched, fetched, issued, disk)
    return x + with_shared(cfg, lp, h, out).reshape(x.shape), pool, fields


# --- the layer scan ---------------------------------------------------------------------------


def _next_rows(tree: Any) -> Any:
    """Each layer's entry replaced by the next layer's (the last by the first): what the
    next-gate predictor of layer l reads."""
    return jax.tree.map(lambda a: jnp.roll(a, -1, axis=0), tree)


def run_layers(cfg: ModelConfig, plan: StepPlan, params, pool: ExpertPool, tiers: Tiers, x,
               positions, token_live, k_all, v_all, row=None):
    """Every layer over the chunk x [B, T, D] at `positions` [B, T]; `token_live` [B * T]
    marks tokens whose routing counts (and moves experts). Returns x, the caches, the pool
    and the StepRecord."""
    layers = params["layers"]
    num_layers = cfg.num_layers
    router_keys = ("mlp_norm", "router", "router_bias")
    next_lp = _next_rows({k: layers[k] for k in router_keys if k in layers})
    xs = (layers, jnp.arange(num_layers), tiers.page, tiers.host_page, next_lp,
          _next_rows(tiers.page), _next_rows(tiers.host_page))
    pre0 = jnp.full((max(plan.staging, 1),), -1, jnp.int32)

    def body(carry, xs):
        x, k_all, v_all, pool, pre_ids = carry
        lp, layer, page_row, host_row, nlp, next_page, next_host = xs
        x, k_all, v_all = _attention(cfg, lp, x, positions, k_all, v_all, layer, row)
        half = layer % 2  # staging half this layer's demand copies use
        x_attn = x
        x, pool, fields = _moe(cfg, plan, lp, x, pool, tiers.host, (page_row, host_row),
                               token_live, pre_ids, half)
        if plan.staging and plan.predictor == "next-gate":
            pool, pre_ids = _prefetch(cfg, plan, pool, tiers.host, x_attn, nlp, next_page,
                                      next_host, token_live, half, layer + 1 == num_layers)
        else:
            pre_ids = pre0
        return (x, k_all, v_all, pool, pre_ids), fields

    (x, k_all, v_all, pool, _), fields = jax.lax.scan(
        body, (x, k_all, v_all, pool, pre0), xs, unroll=plan.unroll)
    return x, k_all, v_all, pool, _record(fields)


def _record(fields) -> StepRecord:
    counts, experts, hits, prefetched, fetched, issued, disk = fields
    return StepRecord(counts=counts, experts=experts, hits=hits, prefetched=prefetched,
                      fetched=fetched, issued=issued, disk=disk)


# --- the programs -----------------------------------------------------------------------------
# Each program is jitted twice from one function: the offload engine's copy donates the pool
# (its staging halves are written in place); with `staging=0` the pool is only read, and is not
# returned (a returned, undonated pool would be copied whole).

_STATIC = ("cfg", "plan")


def decode_step(cfg: ModelConfig, plan: StepPlan, params, pool: ExpertPool, tiers: Tiers,
            state: DecodeState):
    """One token for every live row: (the state with the next tokens, StepOutput, the pool
    (None when `plan.staging` is 0))."""
    x = params["embed"][state.tokens][:, None, :]
    positions = jnp.where(state.live, state.positions, state.max_len)[:, None]
    x, k, v, pool, record = run_layers(cfg, plan, params, pool, tiers, x, positions,
                                       state.live, state.k, state.v)
    logits = lm_head(cfg, params, x[:, 0])
    if plan.sample:
        nxt = sample(logits, state.sampler, state.positions + 1)
    else:
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    nxt = jnp.where(state.live, nxt, state.tokens)
    rows = jnp.arange(nxt.shape[0])
    state = state.replace(tokens=nxt, positions=state.positions + state.live.astype(jnp.int32),
                          k=k, v=v, sampler=mark_seen(state.sampler, rows, nxt, state.live))
    out = StepOutput(tokens=nxt, logits=logits, record=record)
    return state, out, pool if plan.staging else None


def prefill_step(cfg: ModelConfig, plan: StepPlan, params, pool: ExpertPool, tiers: Tiers,
             state: DecodeState, row, tokens, start, count, sampling=None):
    """A chunk of one row's prompt: tokens [T] (the first `count` real) placed at positions
    start, start + 1, ... of row `row`, which becomes live with its next token at position
    start + count, drawn by `sampling` (`sampling.row_values`, None: greedy; the row's
    settings from now on; at start 0 its sequence starts anew). Returns (state, StepOutput
    with the logits [V] of the chunk's last real token, pool (None when `plan.staging` is
    0))."""
    t = tokens.shape[0]
    real = jnp.arange(t) < count
    positions = jnp.where(real, start + jnp.arange(t), state.max_len)[None].astype(jnp.int32)
    x = params["embed"][tokens][None]
    x, k, v, pool, record = run_layers(cfg, plan, params, pool, tiers, x, positions, real,
                                       state.k, state.v, row=row)
    logits = lm_head(cfg, params, x[0, jnp.maximum(count - 1, 0)])
    sampler = set_row(state.sampler, row, row_values(GREEDY) if sampling is None else sampling,
                      start == 0)
    sampler = mark_seen(sampler, jnp.full((t,), row), tokens, real)
    own = jax.tree.map(lambda a: a[row][None], sampler)
    nxt = sample(logits[None], own, jnp.reshape(start + count, (1,)))[0]
    sampler = mark_seen(sampler, jnp.reshape(row, (1,)), nxt[None], jnp.ones((1,), jnp.bool_))
    state = state.replace(tokens=state.tokens.at[row].set(nxt), sampler=sampler,
                          positions=state.positions.at[row].set(start + count),
                          live=state.live.at[row].set(True), k=k, v=v)
    out = StepOutput(tokens=nxt, logits=logits, record=record)
    return state, out, pool if plan.staging else None


COMPILER_OPTIONS = {"xla_allow_excess_precision": False}
"""Every program rounds each op to its dtype: left to itself XLA keeps fused bf16
intermediates in f32, which differs between fusions, so the bits would depend on how the
program was fused (rolled or not, offloaded or not)."""

_jit = functools.partial(jax.jit, static_argnames=_STATIC, compiler_options=COMPILER_OPTIONS)
decode = _jit(decode_step, donate_argnames=("state",))
decode_staged = _jit(decode_step, donate_argnames=("state", "pool"))
prefill = _jit(prefill_step, donate_argnames=("state",))
prefill_staged = _jit(prefill_step, donate_argnames=("state", "pool"))

PREFILL_CHUNK = 64  # tokens per prefill program; shorter tails take a power-of-two bucket


def prefill_chunks(length: int) -> list[tuple[int, int, int]]:
    """(start, bucket, count) of each prefill chunk of a `length`-token prompt: every path
    chunks a prompt the same way, so every path gives the same bits."""
    chunks = []
    for start in range(0, length, PREFILL_CHUNK):
        count = min(PREFILL_CHUNK, length - start)
        chunks.append((start, max(8, 1 << (count - 1).bit_length()), count))
    return chunks


def forward_pass(cfg: ModelConfig, plan: StepPlan, params, pool: ExpertPool, tiers: Tiers,
                 tokens):
    """Full causal forward of tokens [B, T] -> (float32 logits [B, T, V], StepRecord); every
    expert has a slot (`plan.staging` 0). Traceable inside other programs (training);
    `forward` is its compiled program."""
    b, t = tokens.shape
    shape = (cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim)
    k = jnp.zeros(shape, jnp.dtype(cfg.dtype))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    live = jnp.ones((b * t,), jnp.bool_)
    x, _, _, _, record = run_layers(cfg, plan, params, pool, tiers, params["embed"][tokens],
                                    positions, live, k, k)
    return lm_head(cfg, params, x), record


forward = _jit(forward_pass)
