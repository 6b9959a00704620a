"""The model as a Flax (linen) module: dense weights are its params, experts its call arguments.

docs/design.md, "The step". `MoEModel` holds the globals (embed, final norm, lm head) and
`layers`: one `DecoderLayer` scanned over the layer axis by `nn.scan`, so the param tree is
`{"params": {"embed", "final_norm", ["lm_head"], "layers": {name: [L, ...]}}}`, each layer param
stacked over layers as `api.dense_params` and the checkpoint reader lay it out. The expert pool,
the tiers (page tables, pinned-host tier), the KV cache and the next layer's router params (what
the prefetch reads) enter as call arguments and as the scan's carry and xs, never as params: one
compiled program serves every residency. Pure functional: `init` / `apply`, no state kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from strata_jax.formats.checkpoint import (
    MIXER_KINDS,
    dense_layer_arrays,
    global_shapes,
    mixer_arrays,
    mixer_counts,
    mlp_layer_arrays,
    numpy_dtype,
)
from strata_jax.formats.config import ModelConfig
from strata_jax.model.decoder import (
    cached_attention,
    dense_mlp,
    fuse_qkv,
    lm_head,
    prefetch,
    tiered_moe,
)
from strata_jax.model.linear_attention import gated_delta_net
from strata_jax.ops.layers import rms_norm
from strata_jax.ops.pool import ExpertPool

if TYPE_CHECKING:
    from strata_jax.step.plan import StepPlan, Tiers

# what layer l's prefetch reads of layer l+1
ROUTER_KEYS = ("mlp_norm", "router", "router_bias", "router_correction")
Variables = dict[str, Any]


@functools.cache
def layer_specs(cfg: ModelConfig, dense: str = "none",
                mlp: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
    """One MoE layer's dense params as the module declares them (`mlp`: one dense-MLP
    layer's): the stored arrays of a checkpoint whose dense quantization is `dense` ("none" /
    "int8", `checkpoint.dense_layer_arrays`), with q/k/v fused (`model.fuse_qkv`)."""
    arrays = mlp_layer_arrays if mlp else dense_layer_arrays
    stored = arrays(cfg, {"dense": dense, "experts": "none"})
    structs = {k: jax.ShapeDtypeStruct(shape, numpy_dtype(dtype))
               for k, (shape, dtype) in stored.items()}
    return jax.eval_shape(fuse_qkv, structs)


@functools.cache
def mixer_specs(cfg: ModelConfig, kind: str) -> dict[str, jax.ShapeDtypeStruct]:
    """One token mixer's params of `kind` ("attn" / "linear") in a model with linear layers,
    as the module declares them (float; q/k/v fused)."""
    structs = {k: jax.ShapeDtypeStruct(shape, numpy_dtype(dtype))
               for k, (shape, dtype) in mixer_arrays(cfg, kind).items()}
    return jax.eval_shape(fuse_qkv, structs)


def dense_quant(variables: Variables) -> str:
    """The dense quantization of a param tree: "int8" when its layers carry scales."""
    return "int8" if "wo_scale" in variables["params"]["layers"] else "none"


def _layer_params(module: nn.Module, cfg: ModelConfig, dense: str, mlp: bool) -> dict:
    """The layer's params, declared from `layer_specs`."""
    if not module.is_initializing() and module.has_variable("params", "wo_scale") != (
            dense == "int8"):
        raise ValueError(f"params do not match dense={dense!r} (see `model_for`)")
    return {k: module.param(k, _initializer(k, s.dtype), s.shape, s.dtype)
            for k, s in layer_specs(cfg, dense, mlp).items()}


def model_for(cfg: ModelConfig, plan: StepPlan, variables: Variables) -> MoEModel:
    """The module that applies `variables` under `plan`."""
    return MoEModel(cfg, plan, dense_quant(variables))


def _initializer(name: str, dtype) -> Callable[..., jax.Array]:
    """Norm weights and scales 1, biases and int8 codes 0, the embedding N(0, 1), every other
    weight N(0, 1 / fan-in) (the LM head [V, D] reads D inputs, the others their axis 0)."""
    if jnp.issubdtype(dtype, jnp.integer) or name in ("bqkv", "router_bias",
                                                       "router_correction"):
        return nn.initializers.zeros
    if name.endswith(("norm", "_scale")):
        return nn.initializers.ones
    if name == "embed":
        return nn.initializers.normal(1.0)
    fan_in = -1 if name == "lm_head" else 0

    def init(key: jax.Array, shape: tuple[int, ...], dtype=dtype) -> jax.Array:
        return jax.random.normal(key, shape, dtype) * jnp.asarray(shape[fan_in] ** -0.5, dtype)

    return init


def _stacked_init(init: Callable[..., jax.Array], n: int) -> Callable[..., jax.Array]:
    """`init` drawn for each of n stacked layers (so its fan-in is the layer's)."""

    def stacked(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
        return jax.vmap(lambda k: init(k, shape[1:], dtype))(jax.random.split(key, n))

    return stacked


class MixerParams(nn.Module):
    """The token-mixer params of one kind ("attn" / "linear") of a model with linear layers,
    stacked over the layers of that kind (`ModelConfig.mixer_slots`); calling it gives them."""

    cfg: ModelConfig
    """The model's shape and math switches."""
    kind: str
    """"attn" or "linear"."""

    def setup(self) -> None:
        n = mixer_counts(self.cfg)[self.kind]
        self.stack = {k: self.param(k, _stacked_init(_initializer(k, s.dtype), n),
                                    (n, *s.shape), s.dtype)
                      for k, s in mixer_specs(self.cfg, self.kind).items()}

    def __call__(self) -> dict[str, jax.Array]:
        return dict(self.stack)


class LayerCarry(NamedTuple):
    """What one layer hands the next: the residual stream, the stacked caches, the pool and
    the experts it prefetched into the next layer's staging half (-1: none)."""

    x: jax.Array
    """[N, D] residual stream of the chunk's tokens, flat: the B x T tokens of its rows, then
    the riders' (`ChunkInputs.riders`)."""
    k: jax.Array
    """The cache's first array over every layer: keys (MLA: the latent), `cache_shapes`."""
    v: jax.Array
    """Its second: values (MLA: the rope key)."""
    pool: ExpertPool
    """The device pool (slots, cache slots, the two staging halves)."""
    prefetched: jax.Array
    """[max(staging, 1)] int32 expert ids prefetched for the next layer."""
    saved: jax.Array | None = None
    """[N, D]: the input of the first layer that routed to an expert found only on disk,
    what the step resumes from (None: no resume compiled)."""
    stalled: jax.Array | None = None
    """bool []: a layer so far routed to an expert found only on disk."""
    conv: jax.Array | None = None
    """The linear layers' conv states [L_lin, B, K - 1, C] (None: no linear layers)."""
    rec: jax.Array | None = None
    """The linear layers' recurrent states [L_lin, B, Hv, dk, dv] float32."""


class LayerRows(NamedTuple):
    """Each layer's slice of the step's per-layer inputs (the scan's xs)."""

    layer: jax.Array
    """The layer index."""
    page: jax.Array
    """[E] int32 pool slot of each expert, or -1."""
    host_page: jax.Array
    """[E] int32 pinned-host slot of each expert, or -1."""
    next_router: dict[str, jax.Array] | None
    """The next layer's `ROUTER_KEYS` params (the last layer: the first's); None: no
    prefetch compiled (or at `init`, before the params exist)."""
    next_page: jax.Array
    """The next layer's `page`."""
    next_host_page: jax.Array
    """The next layer's `host_page`."""
    forced: jax.Array | None = None
    """[N, k] int32 replayed picks of the layer (-1: the router's); None: no replay."""
    owner: jax.Array | None = None
    """[E] int32 the device that owns each expert, over an expert axis; None: one device."""


class ChunkInputs(NamedTuple):
    """What every layer reads alike (broadcast over the scan)."""

    positions: jax.Array
    """[B, T] int32 cache position of each token (out of range: dropped)."""
    token_live: jax.Array
    """[N] bool: tokens whose routing counts and moves experts (the riders' last)."""
    host: ExpertPool | None
    """The pinned-host tier (None when every expert has a device slot)."""
    row: jax.Array | None
    """[B] int32 the cache row each row of a prefill chunk writes (at or past the batch
    capacity: a padding row, which writes nothing), or None: row b of the batch."""
    resume: tuple[jax.Array, jax.Array] | None = None
    """(first layer, its input [N, D]): layers before the first pass their input through
    and write nothing (-1: a run from the start); None: no resume compiled."""
    host_work: Any = None
    """`misses.HostWork` for plans that compute misses on the host, else None."""
    riders: jax.Array | None = None
    """[C] int32: a decode step of the batch's C rows riding along in the same program (row c
    attends over cache row c with its one token at this position; out of range: not riding,
    docs/design.md, "Prefill"), or None: no riders compiled."""
    mixers: tuple[dict[str, jax.Array], dict[str, jax.Array]] | None = None
    """The stacked token-mixer params (attention layers', linear layers') of a model with
    linear layers (`MixerParams`), else None."""


class DecoderLayer(nn.Module):
    """One decoder layer over a chunk: attention over the cache, then the MoE block with its
    experts served from the pool and the tiers (`model.tiered_moe`), then the next-gate prefetch
    for the next layer. Its params are the layer's dense params (`layer_specs`)."""

    cfg: ModelConfig
    """The model's shape and math switches."""
    plan: StepPlan
    """What is compiled besides the shape (staging, predictor, kernel knobs)."""
    dense: str = "none"
    """Dense quantization: "none", or "int8" (matrices int8 with per-channel scales)."""

    @nn.compact
    def __call__(self, carry: LayerCarry, rows: LayerRows, inputs: ChunkInputs):
        cfg, plan = self.cfg, self.plan
        lp = _layer_params(self, cfg, self.dense, mlp=False)
        x_in, positions, token_live, skip = _resumed(carry, rows, inputs)
        # The layer's math sits between two barriers in every program, so what the resume
        # (or its absence) puts around it cannot change how it is fused, nor its bits
        # (docs/design.md, "Measured").
        x_in, positions, token_live = jax.lax.optimization_barrier(
            (x_in, positions, token_live))
        before = (carry.conv, carry.rec)
        x, carry = _mixer(cfg, lp, x_in, positions, carry, rows.layer, inputs)
        half = rows.layer % 2  # staging half this layer's demand copies use
        x_attn = x
        x, pool, record = tiered_moe(cfg, plan, lp, x, carry.pool, inputs.host,
                                     (rows.page, rows.host_page, rows.owner), token_live,
                                     carry.prefetched, half, inputs.host_work, rows.forced)
        if rows.next_router is None:
            pre_ids = jnp.full((max(plan.staging, 1),), -1, jnp.int32)
        else:
            last = rows.layer + 1 == cfg.num_layers
            pool, pre_ids = prefetch(cfg, plan, pool, inputs.host, x_attn, rows.next_router,
                                     rows.next_page, rows.next_host_page, token_live,
                                     half, last)
        x = jax.lax.optimization_barrier(x)
        carry = carry._replace(pool=pool, prefetched=pre_ids)
        if skip is None:
            return carry._replace(x=x), record
        stall = jnp.any(record["disk"])
        saved = jnp.where(stall & ~carry.stalled, x_in, carry.saved)
        if cfg.linear_layers:  # the step runs again from the stalled layer: keep its state
            carry = _state_kept(cfg, rows.layer, carry.stalled | stall, before, carry)
        return carry._replace(x=jnp.where(skip, x_in, x), saved=saved,
                              stalled=carry.stalled | stall), record


class MLPLayer(nn.Module):
    """One dense-MLP layer (`ModelConfig.dense_layers`, before the MoE layers): attention over
    the cache, then a plain SwiGLU MLP. No experts, so no record; with a resume compiled it is
    skipped whenever the step resumes (every MoE layer comes after it)."""

    cfg: ModelConfig
    """The model's shape and math switches."""
    dense: str = "none"
    """Dense quantization: "none", or "int8"."""

    @nn.compact
    def __call__(self, carry: tuple[jax.Array, jax.Array, jax.Array], layer: jax.Array,
                 inputs: ChunkInputs):
        cfg = self.cfg
        lp = _layer_params(self, cfg, self.dense, mlp=True)
        x, k_all, v_all = carry
        positions = (inputs.positions, inputs.riders)
        if inputs.resume is not None:  # a resumed step: writes nothing here (see _resumed)
            positions = jax.tree.map(
                lambda p: jnp.where(inputs.resume[0] >= 0, k_all.shape[2], p), positions)
        x, positions = jax.lax.optimization_barrier((x, positions))
        x, k_all, v_all = _attention(cfg, lp, x, positions, k_all, v_all, layer, inputs.row)
        x = dense_mlp(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_eps), x)
        return (jax.lax.optimization_barrier(x), k_all, v_all), None


def _attention(cfg: ModelConfig, lp, x, positions, k_all, v_all, layer, row):
    """`cached_attention` of the chunk's rows (positions[0] [B, T], cache rows `row`) and of
    the riders (positions[1] [C] or None, cache row c each) over the flat stream x [N, D]."""
    main, riders = positions
    b, t = main.shape
    x_main, k_all, v_all = cached_attention(cfg, lp, x[: b * t].reshape(b, t, -1), main,
                                            k_all, v_all, layer, row)
    x_main = x_main.reshape(b * t, -1)
    if riders is None:
        return x_main, k_all, v_all
    x_ride, k_all, v_all = cached_attention(cfg, lp, x[b * t:, None], riders[:, None],
                                            k_all, v_all, layer, None)
    return jnp.concatenate([x_main, x_ride[:, 0]]), k_all, v_all


def _mixer(cfg: ModelConfig, lp, x, positions, carry: LayerCarry, layer, inputs: ChunkInputs
           ) -> tuple[jax.Array, LayerCarry]:
    """MoE layer `layer`'s token mixer over the flat stream x (residual included): attention
    over the cache, or in a model with linear layers the layer's kind (`mixer_slots`) chosen
    by a `lax.cond`, its params and its state the rows of its kind's stacks."""
    if not cfg.linear_layers:
        x, k, v = _attention(cfg, lp, x, positions, carry.k, carry.v,
                             layer + cfg.dense_layers, inputs.row)
        return x, carry._replace(k=k, v=v)
    linear, slots = (jnp.asarray(t) for t in cfg.mixer_slots())
    slot = slots[layer]
    attn_stack, linear_stack = inputs.mixers

    def own(stack):
        return {"attn_norm": lp["attn_norm"], **jax.tree.map(lambda a: a[slot], stack)}

    def attend(ops):
        x, k, v, conv, rec = ops
        x, k, v = _attention(cfg, own(attn_stack), x, positions, k, v, slot, inputs.row)
        return x, k, v, conv, rec

    def delta(ops):
        x, k, v, conv, rec = ops
        x, conv, rec = _linear(cfg, own(linear_stack), x, positions, conv, rec, slot,
                               inputs.row, k.shape[2])
        return x, k, v, conv, rec

    ops = (x, carry.k, carry.v, carry.conv, carry.rec)
    if cfg.attention_layers == 0:
        x, k, v, conv, rec = delta(ops)
    else:
        x, k, v, conv, rec = jax.lax.cond(linear[layer], delta, attend, ops)
    return x, carry._replace(k=k, v=v, conv=conv, rec=rec)


def _linear(cfg: ModelConfig, lp, x, positions, conv, rec, slot, row, max_len):
    """`gated_delta_net` of the chunk's rows (positions[0] [B, T], state rows `row`) and of
    the riders (positions[1] [C] or None, state row c each) over the flat stream x [N, D]."""
    main, riders = positions
    b, t = main.shape
    x_main, conv, rec = gated_delta_net(cfg, lp, x[: b * t].reshape(b, t, -1), main, conv,
                                        rec, slot, row, max_len)
    x_main = x_main.reshape(b * t, -1)
    if riders is None:
        return x_main, conv, rec
    x_ride, conv, rec = gated_delta_net(cfg, lp, x[b * t:, None], riders[:, None], conv, rec,
                                        slot, None, max_len)
    return jnp.concatenate([x_main, x_ride[:, 0]]), conv, rec


def _state_kept(cfg: ModelConfig, layer, stalled, before, carry: LayerCarry) -> LayerCarry:
    """`carry` with linear layer `layer`'s conv and recurrent state as they were `before` it
    ran where `stalled` (this layer or an earlier one of this run found an expert only on
    disk): a Gated DeltaNet update is not idempotent, and the run of the step again from the
    stalled layer (docs/design.md, "Disk stalls") applies it then, once. A layer before the
    resume layer writes nothing either way (its positions are out of range)."""
    linear, slots = (jnp.asarray(t) for t in cfg.mixer_slots())
    keep = stalled & linear[layer]
    slot = slots[layer]

    def kept(old, new):
        return new.at[slot].set(jnp.where(keep, old[slot], new[slot]))

    return carry._replace(conv=kept(before[0], carry.conv), rec=kept(before[1], carry.rec))


def _resumed(carry: LayerCarry, rows: LayerRows, inputs: ChunkInputs):
    """(the layer's input, (positions, the riders' positions), live tokens, whether it is
    skipped): a layer before the resume layer is skipped (positions out of range drop its
    cache writes, no token routes or moves an expert) and the resume layer takes the saved
    input (docs/design.md, "Disk stalls"). Without resume compiled, the chunk's own, and skip
    None."""
    positions = (inputs.positions, inputs.riders)
    if inputs.resume is None:
        return carry.x, positions, inputs.token_live, None
    first, saved = inputs.resume
    skip = rows.layer < first
    x = jnp.where(rows.layer == first, saved, carry.x)
    positions = jax.tree.map(lambda p: jnp.where(skip, carry.k.shape[2], p), positions)
    return x, positions, inputs.token_live & ~skip, skip


def empty_linear_states(cfg: ModelConfig, batch: int) -> tuple[jax.Array, jax.Array] | None:
    """Zero (conv, recurrent) states of the linear layers for `batch` rows
    (`ModelConfig.linear_state_specs`), or None without them."""
    if not cfg.linear_layers:
        return None
    conv, rec = (jnp.zeros(shape, jnp.dtype(dtype))
                 for shape, dtype in cfg.linear_state_specs(batch))
    return conv, rec


def _next_rows(tree: Any) -> Any:
    """Each layer's entry replaced by the next layer's (the last by the first)."""
    return jax.tree.map(lambda a: jnp.roll(a, -1, axis=0), tree)


class MoEModel(nn.Module):
    """The decoder: embedding, the scanned `DecoderLayer`s (`layers`), final norm, LM head.

    `__call__` is the full causal forward (what `init` traces); `chunk` runs a chunk of
    tokens against a cache (the step's decode and prefill); `run_layers` is the layer scan."""

    cfg: ModelConfig
    """The model's shape and math switches."""
    plan: StepPlan
    """What is compiled besides the shape; its `unroll` unrolls the layer scan."""
    dense: str = "none"
    """Dense quantization: "none" or "int8" (`dense_quant` reads it off a param tree)."""

    def setup(self) -> None:
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        self.globals = {k: self.param(k, _initializer(k, dtype), shape, dtype)
                        for k, shape in global_shapes(cfg).items()}
        scanned = nn.scan(DecoderLayer, variable_axes={"params": 0},
                          split_rngs={"params": True}, in_axes=(0, nn.broadcast),
                          length=cfg.num_layers, unroll=self.plan.unroll,
                          check_constancy_invariants=False)
        self.layers = scanned(cfg, self.plan, self.dense)
        if cfg.dense_layers:
            mlp = nn.scan(MLPLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                          in_axes=(0, nn.broadcast), length=cfg.dense_layers,
                          unroll=self.plan.unroll, check_constancy_invariants=False)
            self.mlp_layers = mlp(cfg, self.dense)
        if cfg.linear_layers:
            self.mixers = {k: MixerParams(cfg, k, name=f"{k}_layers")
                           for k, n in mixer_counts(cfg).items() if n}

    def __call__(self, tokens: jax.Array, pool: ExpertPool, tiers: Tiers):
        """Full causal forward of tokens [B, T] through a fresh cache of T positions, every
        token live: (float32 logits [B, T, V], the record's fields, each [L, ...])."""
        cfg = self.cfg
        b, t = tokens.shape
        k, v = (jnp.zeros(s, jnp.dtype(cfg.dtype)) for s in cfg.cache_shapes(b, t))
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        live = jnp.ones((b * t,), jnp.bool_)
        logits, (_, _, _, record, _, _) = self.chunk(tokens, positions, live, pool, tiers, k,
                                                     v, lin=empty_linear_states(cfg, b))
        return logits, record

    def chunk(self, tokens, positions, token_live, pool: ExpertPool, tiers: Tiers, k_all,
              v_all, row=None, pick=None, resume=None, forced=None, riders=None, every=False,
              lin=None):
        """Tokens [B, T] at `positions` [B, T] against the caches: embed, `run_layers`, the LM
        head of `pick(x)` (None: every position). `riders`: (tokens [C], positions [C]) of a
        decode step riding along (`ChunkInputs.riders`); `lin`: the linear layers' (conv,
        recurrent) states (None: no linear layers). Returns (float32 logits, (k_all, v_all,
        pool, the record's fields, the saved input to resume from (None without resume), the
        linear states)); with riders or `every` the logits are a dict: "picked" (as above),
        "riders" ([C, V] or None) and "every" (every position's final stream [B, T, D], before
        the norm and the LM head, or None: `step.score_positions` takes its LM head)."""
        b, t = tokens.shape
        x = self.globals["embed"][tokens]
        ride = None
        if riders is not None:
            ride = (self.globals["embed"][riders[0]], riders[1])
        x, k_all, v_all, pool, record, saved, lin = self.run_layers(
            x, positions, token_live, pool, tiers, k_all, v_all, row, resume, forced, ride,
            lin)
        x_main = x[: b * t].reshape(b, t, -1)
        logits = lm_head(self.cfg, self.globals, x_main if pick is None else pick(x_main))
        if riders is not None or every:
            logits = {"picked": logits,
                      "riders": None if riders is None else lm_head(self.cfg, self.globals,
                                                                    x[b * t:]),
                      "every": x_main if every else None}
        return logits, (k_all, v_all, pool, record, saved, lin)

    def run_layers(self, x, positions, token_live, pool: ExpertPool, tiers: Tiers, k_all,
                   v_all, row=None, resume=None, forced=None, riders=None, lin=None):
        """Every layer over the chunk x [B, T, D] at `positions` [B, T]; `token_live` [N]
        marks tokens whose routing counts (and moves experts); `row` [B]: the cache rows of a
        prefill chunk's rows (None: row b is batch row b); `resume`: (first layer, its input), see
        `ChunkInputs.resume`; `forced` [L, N, k]: replayed picks (-1: the router's; None:
        the router's everywhere); `riders`: (x [C, D], positions [C]) of a decode step riding
        along; `lin`: the linear layers' (conv, recurrent) states (`empty_linear_states`;
        None without linear layers). Returns x [N, D] (flat, the riders' last), the caches,
        the pool, the record's fields (`step.StepRecord`), each [L, ...], the input of the
        first layer that stalled on disk (None without resume) and the linear states."""
        x = x.reshape(-1, x.shape[-1])
        if riders is not None:
            x = jnp.concatenate([x, riders[0]])
        n = self.cfg.num_layers
        mixers = None
        if self.cfg.linear_layers:
            if lin is None:
                raise ValueError(f"{self.cfg.family}: a model with linear layers needs their "
                                 "states (`lin`)")
            mixers = tuple(self.mixers[k]() if k in self.mixers else {} for k in MIXER_KINDS)
        inputs = ChunkInputs(positions, token_live, tiers.host, row, resume, tiers.host_work,
                             None if riders is None else riders[1], mixers)
        if self.cfg.dense_layers:
            (x, k_all, v_all), _ = self.mlp_layers(
                (x, k_all, v_all), jnp.arange(self.cfg.dense_layers), inputs)
        rows = LayerRows(layer=jnp.arange(n), page=tiers.page, host_page=tiers.host_page,
                         next_router=self._next_router(), next_page=_next_rows(tiers.page),
                         next_host_page=_next_rows(tiers.host_page), forced=forced,
                         owner=tiers.owner)
        pre0 = jnp.full((max(self.plan.staging, 1),), -1, jnp.int32)
        carry = LayerCarry(x, k_all, v_all, pool, pre0)
        if resume is not None:
            carry = carry._replace(saved=jnp.zeros_like(x), stalled=jnp.zeros((), jnp.bool_))
        if lin is not None:
            carry = carry._replace(conv=lin[0], rec=lin[1])
        carry, record = self.layers(carry, rows, inputs)
        lin = None if lin is None else (carry.conv, carry.rec)
        return carry.x, carry.k, carry.v, carry.pool, record, carry.saved, lin

    def _next_router(self) -> dict[str, jax.Array] | None:
        """The stacked router params rolled by one layer, for the next-gate prefetch; None
        without it, and at `init` (the params do not exist yet; a prefetch changes no
        output bit)."""
        prefetches = self.plan.staging and self.plan.predictor == "next-gate"
        if not prefetches or self.is_initializing():
            return None
        layers = self.variables["params"]["layers"]
        return _next_rows({k: layers[k] for k in ROUTER_KEYS if k in layers})
