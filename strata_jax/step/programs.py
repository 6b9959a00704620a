"""The one compiled step: a scan over layers with the experts' misses served inside it.

docs/design.md, "The step". One jitted program runs a decode step (or a prefill chunk) of the
whole model, the Flax module `flax_model.MoEModel` applied to the dense params with the pool,
the tiers and the cache as call arguments: per layer, attention writes this step's k/v into
the stacked cache, the router picks experts, the device page table says which sit in an HBM
slot, the misses are copied from the stacked pinned-host tier into a staging half of the slot
pool by a dynamic slice and `device_put` (only the slice moves), the experts predicted for the
next layer are copied into the other half, and the expert kernel reads every expert from the
one pool by slot. Nothing is read back to the host inside the program: it returns the new
state and a small record of what each layer routed and moved, which the host reads after the
next step is dispatched.

Resident is the case where every expert has a slot: `StepPlan(staging=0)` compiles no miss
handling at all (a data-dependent loop costs a device->host sync of its trip count on GPUs).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.formats.config import ModelConfig
from strata_jax.model.decoder import lm_head
from strata_jax.model.flax_model import MoEModel, empty_linear_states, model_for
from strata_jax.ops.pool import ExpertPool
from strata_jax.step.plan import PREDICTORS, StepPlan, Tiers  # noqa: F401 (re-exported)
from strata_jax.step.sampling import (
    SamplerRows,
    greedy_rows,
    mark_seen,
    sample,
    set_row,
)


@chex.dataclass(frozen=True)
class DecodeState:
    """What a decode step reads and writes, one entry per row of the fixed batch.

    `tokens` [B] int32: each row's last token, placed at `positions` [B] by the next step;
    `k`, `v`: the cache over every layer (`ModelConfig.cache_shapes`); `live` [B] bool: rows in use
    (others compute on padding, route nothing and move nothing); `sampler`: each row's
    sampling settings and the tokens its sequence has seen; `conv`, `rec`: the linear
    layers' conv and recurrent states (`ModelConfig.linear_state_specs`; None without linear
    layers), beside the KV cache of the attention layers."""

    tokens: jax.Array
    positions: jax.Array
    k: jax.Array
    v: jax.Array
    live: jax.Array
    sampler: SamplerRows
    conv: jax.Array | None = None
    rec: jax.Array | None = None

    @property
    def lin(self) -> tuple[jax.Array, jax.Array] | None:
        """The linear layers' (conv, recurrent) states, or None."""
        return None if self.conv is None else (self.conv, self.rec)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


@chex.dataclass(frozen=True)
class StepRecord:
    """Per layer, what a step routed and moved (leading axis: layers).

    `counts` [L, E] int32: live tokens routed to each expert; `experts` [L, N, k] int32 every
    token's picks (N = B for decode); `hits`, `prefetched`, `fetched` [L] int32: distinct
    routed experts served from a tier-0 slot, from the prefetch half, copied on demand;
    `hosted` [L] int32 misses computed on the host instead (`StepPlan.miss`);
    `issued` [L] int32 experts prefetched for this layer; `disk` [L, E] bool: routed experts
    found on no faster tier (the step's output is not valid for their rows; docs/design.md,
    "Disk stalls"). Over an expert axis (`expert_parallel.programs`) `hits`, `prefetched`,
    `fetched` and `issued` are [L, n]: what each of the n devices served of its own experts
    and copied over its own link (`PER_DEVICE`)."""

    counts: jax.Array
    experts: jax.Array
    hits: jax.Array
    prefetched: jax.Array
    fetched: jax.Array
    hosted: jax.Array
    issued: jax.Array
    disk: jax.Array


@jax.jit
def pack_record(record: StepRecord) -> jax.Array:
    """The record as one int32 array: one copy to the host a step instead of one per field,
    each with its own fixed cost (docs/design.md, "The engine")."""
    return jnp.concatenate([jnp.ravel(a).astype(jnp.int32) for a in jax.tree.leaves(record)])


def unpack_record(flat: np.ndarray, like: StepRecord) -> StepRecord:
    """`pack_record`'s inverse on the host: numpy fields of `like`'s shapes and dtypes (read
    from its device arrays' metadata, no transfer)."""
    leaves, treedef = jax.tree.flatten(like)
    fields, at = [], 0
    for leaf in leaves:
        n = math.prod(leaf.shape)
        fields.append(np.asarray(flat[at:at + n]).reshape(leaf.shape).astype(leaf.dtype))
        at += n
    if at != flat.size:
        raise ValueError(f"a packed record of {flat.size} values for fields of {at}")
    return jax.tree.unflatten(treedef, fields)


PER_DEVICE = ("hits", "prefetched", "fetched", "issued")
"""The `StepRecord` counters that an expert axis keeps per device."""


SCORE_TOP = 20
"""Alternatives a score gives per position (the most OpenAI's `top_logprobs` asks for)."""
SCORE_BLOCK = 64
"""Positions whose LM head a scored prefill program computes at once (`score_positions`)."""


@chex.dataclass(frozen=True)
class Scores:
    """Log-probabilities (float32, natural log, of the model's own softmax: no sampling
    filters) at each position of a prefill program's tokens [R, T]."""

    target: jax.Array
    """[R, T] of the position's target token (0 where it has none)."""
    top: jax.Array
    """[R, T, SCORE_TOP] of the most likely tokens, highest first."""
    top_ids: jax.Array
    """[R, T, SCORE_TOP] int32: those tokens."""


def score(logits: jax.Array, targets: jax.Array) -> Scores:
    """`Scores` of float32 logits [..., V] at `targets` [...] (-1: none)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    top, ids = jax.lax.top_k(logp, min(SCORE_TOP, logp.shape[-1]))
    return Scores(target=jnp.where(targets >= 0, target, 0.0), top=top,
                  top_ids=ids.astype(jnp.int32))


@chex.dataclass(frozen=True)
class StepOutput:
    """What a step gives back besides the state it donates and returns: the new tokens
    (`tokens` [B] for decode, the row's next token [] for prefill), their logits float32
    ([B, V]; meaningless for rows not live) and the StepRecord."""

    tokens: jax.Array
    logits: jax.Array
    record: StepRecord
    saved: jax.Array | None = None
    """With `StepPlan.resume`: the input of the first layer that stalled on disk, what the
    next run of the same step resumes from (`Resume`)."""
    start: tuple | None = None
    """With `StepPlan.resume`: the input state's (tokens, positions, sampler), which the step
    replaces and a run of it again needs (the state is donated; copied in the same program,
    so a step that may stall is still one dispatch)."""
    riders: jax.Array | None = None
    """A prefill program's riders' next tokens [C] (`prefill_step`; None: none compiled)."""
    scores: Scores | None = None
    """A prefill program's `Scores` of its targets (None: none compiled)."""


@chex.dataclass(frozen=True)
class Resume:
    """Where a run of a step starts: at layer `layer` (int32 []; -1: the start) from its
    input `saved` [N, D] (`StepOutput.saved` of the stalled run; ignored at -1)."""

    layer: jax.Array
    saved: jax.Array


def from_start(cfg: ModelConfig, tokens: int) -> Resume:
    """A `Resume` that runs a step of `tokens` tokens (riders included) from its first
    layer."""
    return Resume(layer=jnp.full((), -1, jnp.int32),
                  saved=jnp.zeros((tokens, cfg.hidden_size), jnp.dtype(cfg.dtype)))


def init_state(cfg: ModelConfig, batch: int, max_len: int,
               device: jax.Device | jax.sharding.Sharding | None = None) -> DecodeState:
    """An empty state of `batch` rows, committed to `device` (default: the first; a sharding:
    e.g. replicated over a mesh), as the step's outputs are: a step then never meets an
    argument placed otherwise (a recompile)."""
    k_shape, v_shape = cfg.cache_shapes(batch, max_len)
    dtype = jnp.dtype(cfg.dtype)
    state = DecodeState(tokens=jnp.zeros((batch,), jnp.int32),
                        positions=jnp.zeros((batch,), jnp.int32),
                        k=jnp.zeros(k_shape, dtype), v=jnp.zeros(v_shape, dtype),
                        live=jnp.zeros((batch,), jnp.bool_),
                        sampler=greedy_rows(batch, cfg.vocab_size))
    lin = empty_linear_states(cfg, batch)
    if lin is not None:
        state = state.replace(conv=lin[0], rec=lin[1])
    return jax.device_put(state, device or jax.devices()[0])


def resident_tiers(page: jax.Array) -> Tiers:
    """Every expert in a device slot: nothing on the host tiers."""
    return Tiers(page=page, host=None, host_page=jnp.full(page.shape, -1, jnp.int32))


# --- the programs -----------------------------------------------------------------------------
# Each program is jitted twice from one function: the offload engine's copy donates the pool
# (its staging halves are written in place); with `staging=0` the pool is only read, and is not
# returned (a returned, undonated pool would be copied whole).

_STATIC = ("cfg", "plan")


def _resume(cfg: ModelConfig, plan: StepPlan, resume: Resume | None,
            tokens: int) -> tuple[jax.Array, jax.Array] | None:
    """The model's resume argument: None without `plan.resume`; else `resume` (default: from
    the start)."""
    if not plan.resume:
        return None
    resume = resume if resume is not None else from_start(cfg, tokens)
    return resume.layer, resume.saved


def _forced(plan: StepPlan, forced: jax.Array | None) -> jax.Array | None:
    if plan.replay != (forced is not None):
        raise ValueError("StepPlan.replay and the step's `forced` picks go together")
    return forced


def decode_step(cfg: ModelConfig, plan: StepPlan, params, pool: ExpertPool, tiers: Tiers,
            state: DecodeState, resume: Resume | None = None, forced: jax.Array | None = None):
    """One token for every live row: (the state with the next tokens, StepOutput, the pool
    (None when `plan.staging` is 0)). `resume` (with `plan.resume`): run from a layer;
    `forced` [L, B, k] (with `plan.replay`): the replayed picks."""
    positions = jnp.where(state.live, state.positions, state.max_len)[:, None]
    logits, (k, v, pool, record, saved, lin) = model_for(cfg, plan, params).apply(
        params, state.tokens[:, None], positions, state.live, pool, tiers, state.k, state.v,
        pick=lambda x: x[:, 0], method=MoEModel.chunk,
        resume=_resume(cfg, plan, resume, state.tokens.shape[0]),
        forced=_forced(plan, forced), lin=state.lin)
    # a row's sequence takes its input token here, not the token it draws: a step whose
    # token the scheduler drops (a row stepped once past its stop id) leaves no trace
    rows = jnp.arange(state.tokens.shape[0])
    sampler = mark_seen(state.sampler, rows, state.tokens, state.live)
    if plan.sample:
        nxt = sample(logits, sampler, state.positions + 1)
    else:
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    nxt = jnp.where(state.live, nxt, state.tokens)
    before = state
    state = state.replace(tokens=nxt, positions=state.positions + state.live.astype(jnp.int32),
                          k=k, v=v, sampler=sampler, **_lin_fields(lin))
    out = StepOutput(tokens=nxt, logits=logits, record=StepRecord(**record), saved=saved,
                     start=_start(plan, before))
    return state, out, pool if plan.staging else None


def _lin_fields(lin: tuple[jax.Array, jax.Array] | None) -> dict[str, jax.Array]:
    """The DecodeState fields of a step's new linear states (none without linear layers)."""
    return {} if lin is None else {"conv": lin[0], "rec": lin[1]}


def _start(plan: StepPlan, state: DecodeState) -> tuple | None:
    return (state.tokens, state.positions, state.sampler) if plan.resume else None


def prefill_step(cfg: ModelConfig, plan: StepPlan, params, pool: ExpertPool, tiers: Tiers,
                 state: DecodeState, rows, tokens, starts, counts, sampling=None, riders=None,
                 targets=None, resume: Resume | None = None, forced: jax.Array | None = None):
    """Chunks of R rows' prompts in one program (`packing`): tokens [R, T], row r's first
    `counts[r]` real, placed at positions starts[r], starts[r] + 1, ... of cache row `rows[r]`
    (at or past the batch capacity: a padding row, which writes and draws nothing). Each row
    becomes live with its next token at position starts[r] + counts[r], drawn by `sampling`
    (`sampling.stack_values` of the rows' `row_values`; None: greedy), its settings from now
    on (at start 0 its sequence starts anew). `riders` bool [C] (None: none compiled): live
    rows of the batch that take a decode step in the same program, as `decode_step` would
    with its sampler, so each expert read serves them too (docs/design.md, "Prefill").
    `targets` int32 [R, T] (None: no scores compiled): the token whose log-probability each
    position scores (-1: none; at a row's last real token: the token it draws), for prompt
    log-probabilities (`Scores`). Returns (state,
    StepOutput with the tokens [R] and the logits [R, V] of each row's last real token, the
    riders' tokens [C], the scores, pool (None when `plan.staging` is 0)). `resume`
    (with `plan.resume`): run from a layer; `forced` [L, N, k] (with `plan.replay`): the
    replayed picks."""
    r, t = tokens.shape
    real = jnp.arange(t)[None, :] < counts[:, None]
    positions = jnp.where(real, starts[:, None] + jnp.arange(t)[None, :],
                          state.max_len).astype(jnp.int32)
    last = jnp.maximum(counts - 1, 0)
    live = real.reshape(-1)
    ride = None
    if riders is not None:
        riders = riders & state.live
        ride = (state.tokens, jnp.where(riders, state.positions, state.max_len))
        live = jnp.concatenate([live, riders])
    logits, (k, v, pool, record, saved, lin) = model_for(cfg, plan, params).apply(
        params, tokens, positions, live, pool, tiers, state.k, state.v, row=rows,
        pick=lambda x: x[jnp.arange(r), last], method=MoEModel.chunk, riders=ride,
        every=targets is not None, resume=_resume(cfg, plan, resume, live.shape[0]),
        forced=_forced(plan, forced), lin=state.lin)
    before = state
    ridden = None
    heads = logits if isinstance(logits, dict) else {}
    logits = heads.get("picked", logits)
    if riders is not None:
        state, ridden = _ride(state, heads["riders"], riders)
    values = _greedy_values(r) if sampling is None else sampling
    sampler = set_row(state.sampler, rows, values, starts == 0)
    sampler = mark_seen(sampler, jnp.repeat(rows, t), tokens.reshape(-1), real.reshape(-1))
    own = jax.tree.map(lambda a: a[jnp.minimum(rows, state.tokens.shape[0] - 1)], sampler)
    nxt = sample(logits, own, starts + counts)
    scores = None
    if targets is not None:
        at_last = (jnp.arange(t)[None, :] == last[:, None]) & (targets < 0)
        scores = score_positions(cfg, params, heads["every"],
                                 jnp.where(at_last, nxt[:, None], targets))
    state = state.replace(tokens=state.tokens.at[rows].set(nxt, mode="drop"), sampler=sampler,
                          positions=state.positions.at[rows].set(starts + counts, mode="drop"),
                          live=state.live.at[rows].set(True, mode="drop"), k=k, v=v,
                          **_lin_fields(lin))
    out = StepOutput(tokens=nxt, logits=logits, record=StepRecord(**record), saved=saved,
                     start=_start(plan, before), riders=ridden, scores=scores)
    return state, out, pool if plan.staging else None


def score_positions(cfg: ModelConfig, params, hidden: jax.Array, targets: jax.Array) -> Scores:
    """`score` of every position of the final stream `hidden` [R, T, D] at `targets` [R, T],
    the LM head taken `SCORE_BLOCK` positions at a time: a long chunk's [R x T, V] logits are
    never whole, so a scored program needs about the workspace the ledger measured for the
    unscored one."""
    r, t = targets.shape
    block = min(SCORE_BLOCK, r * t)  # both powers of two: the block divides R x T
    blocks = (hidden.reshape(r * t // block, block, -1), targets.reshape(-1, block))
    out = jax.lax.map(lambda a: score(lm_head(cfg, params["params"], a[0]), a[1]), blocks)
    return jax.tree.map(lambda x: x.reshape(r, t, *x.shape[2:]), out)


def _ride(state: DecodeState, logits, riders) -> tuple[DecodeState, jax.Array]:
    """The riders' decode step after their logits [C, V]: what `decode_step` does for its
    live rows (the input token joins the sequence, the next is drawn at position + 1), by
    `sample` for greedy rows too (it takes their argmax bit for bit)."""
    sampler = mark_seen(state.sampler, jnp.arange(riders.shape[0]), state.tokens, riders)
    nxt = jnp.where(riders, sample(logits, sampler, state.positions + 1), state.tokens)
    state = state.replace(tokens=nxt, positions=state.positions + riders.astype(jnp.int32),
                          sampler=sampler)
    return state, nxt


def _greedy_values(rows: int) -> tuple:
    """`row_values(GREEDY)` stacked over `rows` rows, built in the program."""
    g = greedy_rows(rows, 1)
    return g.temperature, g.top_k, g.top_p, g.min_p, g.penalty, g.seed


AUTOTUNE = os.environ.get("STRATA_XLA_AUTOTUNE", "0") not in ("", "0")
"""Let XLA's GPU autotuner pick the step's GEMM algorithms (`STRATA_XLA_AUTOTUNE=1`, read at
import). Off by default: the autotuner times candidates in each process and keeps the
fastest, timing noise picks differently in different processes, and the candidates sum in
different orders, so fresh processes gave different tokens (docs/design.md, "Measured")."""

TRITON_GEMM = os.environ.get("STRATA_TRITON_GEMM", "1") not in ("", "0")
"""XLA may emit the step's matmuls as its own Triton GEMM fusions (its default);
`STRATA_TRITON_GEMM=0` (read at import) sends them to cuBLAS instead. Without the autotuner
(`AUTOTUNE`) those fusions run one default tiling whatever the shape: a prefill chunk's expert
tiles ran at a few percent of the GPU's bf16 rate (docs/design.md, "Measured"); cuBLAS picks
its algorithm by shape alone. Opt-in until measured on the GPU."""

COMPILER_OPTIONS = {"xla_allow_excess_precision": False,
                    **({} if AUTOTUNE else {"xla_gpu_autotune_level": 0}),
                    **({} if TRITON_GEMM else {"xla_gpu_enable_triton_gemm": False})}
"""Every program rounds each op to its dtype: left to itself XLA keeps fused bf16
intermediates in f32, which differs between fusions, so the bits would depend on how the
program was fused (rolled or not, offloaded or not). Without `AUTOTUNE` every process
compiles the same choices."""

_jit = functools.partial(jax.jit, static_argnames=_STATIC, compiler_options=COMPILER_OPTIONS)
decode = _jit(decode_step, donate_argnames=("state",))
decode_staged = _jit(decode_step, donate_argnames=("state", "pool"))
prefill = _jit(prefill_step, donate_argnames=("state",))
prefill_staged = _jit(prefill_step, donate_argnames=("state", "pool"))

score_drawn = jax.jit(score, compiler_options=COMPILER_OPTIONS)
"""`score` of a decode step's logits [B, V] at the tokens it drew [B] (a program of its own,
dispatched after the step only when a row asks for its tokens' log-probabilities)."""

set_live = jax.jit(lambda state, row, value: state.replace(live=state.live.at[row].set(value)),
                   donate_argnums=0)
"""Row `row` of a DecodeState live or not (its KV stays until overwritten)."""

MIN_PREFILL_CHUNK = 64
"""The shortest prefill chunk a budget may force (`runtime/engine/offload.py` `plan_for` halves the
default chunk down to this where the workspace of a longer one does not fit)."""
MAX_PREFILL_CHUNK = 1024
"""The longest default prefill chunk: each expert a chunk routes to is read (and, offloaded,
copied) once per layer for all of the chunk's tokens (docs/design.md, "The step"), so a long
chunk divides the expert bytes per prompt token; past this the attention scores of a chunk
[heads, chunk, max_len] dominate the workspace."""


def check_prefill_chunk(chunk: int) -> int:
    """`chunk` if it is a valid prefill chunk (a power of two >= 8: a shorter tail takes a
    power-of-two bucket, and every bucket must fit a chunk), else ValueError."""
    if chunk < 8 or chunk & (chunk - 1):
        raise ValueError(f"prefill_chunk must be a power of two >= 8, got {chunk}")
    return chunk


def default_prefill_chunk(max_len: int) -> int:
    """The prefill chunk of a row of `max_len` positions without a budget to fit: a whole
    prompt in one program up to `MAX_PREFILL_CHUNK` tokens."""
    return max(8, min(MAX_PREFILL_CHUNK, 1 << (max_len - 1).bit_length()))


def prefill_chunks(length: int, chunk: int) -> list[tuple[int, int, int]]:
    """(start, bucket, count) of each prefill chunk of a `length`-token prompt in chunks of
    `chunk` tokens (`check_prefill_chunk`), the tail in a power-of-two bucket: paths that
    chunk a prompt alike give the same bits."""
    chunks = []
    for start in range(0, length, chunk):
        count = min(chunk, length - start)
        chunks.append((start, max(8, 1 << (count - 1).bit_length()), count))
    return chunks


def forward_pass(cfg: ModelConfig, plan: StepPlan, params, pool: ExpertPool, tiers: Tiers,
                 tokens):
    """Full causal forward of tokens [B, T] -> (float32 logits [B, T, V], StepRecord); every
    expert has a slot (`plan.staging` 0). Traceable inside other programs (training);
    `forward` is its compiled program."""
    logits, record = model_for(cfg, plan, params).apply(params, tokens, pool, tiers)
    return logits, StepRecord(**record)


forward = _jit(forward_pass)


class Programs(NamedTuple):
    """The programs an engine runs, chosen once (`PROGRAMS`, `loaded.programs_for`)."""

    decode: Callable
    prefill: Callable
    forward: Callable


PROGRAMS = {False: Programs(decode, prefill, forward),
            True: Programs(decode_staged, prefill_staged, forward)}
"""One device's programs by whether the pool has staging halves (then it is donated and
written in place; otherwise only read)."""
