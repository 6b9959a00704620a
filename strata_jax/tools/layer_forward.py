"""One layer's forward pieces in float32 over many sequences, for calibration and evaluation.

The pieces are the inference functions themselves (`model.causal_attention`,
`model.route_layer`, `model.moe_block`, `model.lm_head`), jitted per config and run over
batches of SEQ_BATCH sequences with one layer's params fused as the model expects them and an
ExpertPool of its experts (slot = expert id); inputs and outputs are numpy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special

from strata_jax.api import fuse_qkv
from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.formats.config import ModelConfig
from strata_jax.model import decoder as mdl
from strata_jax.model.moe import ExpertPool
from strata_jax.ops.expert_kernels import SWIGLU, Glu
from strata_jax.ops.layers import rms_norm

SEQ_BATCH = 16  # calibration sequences per jitted forward call

Params = dict[str, Any]


def device_params(lp: dict[str, np.ndarray]) -> Params:
    """One layer's params as jnp: floats in float32, int8/uint8 codes and bf16 scales as stored."""
    out: Params = {}
    for k, v in lp.items():
        v = np.asarray(v)
        keep = v.dtype in (np.uint8, np.int8) or k.endswith("_scale")
        out[k] = jnp.asarray(v) if keep else jnp.asarray(v, jnp.float32)
    return out


def positions_for(batch: int, length: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


@functools.partial(jax.jit, static_argnames="cfg")
def attention_norm(cfg: ModelConfig, lp: Params, x: jax.Array) -> jax.Array:
    """wq/wk/wv's input: the attention block's rms_norm of residual stream x."""
    return rms_norm(x, lp["attn_norm"], cfg.rms_eps)


@functools.partial(jax.jit, static_argnames="cfg")
def q_lora_input(cfg: ModelConfig, lp: Params, x: jax.Array) -> jax.Array:
    """MLA's wq_b input: the normed q-LoRA bottleneck of residual stream x."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_eps)
    return rms_norm(mdl.linear(h, lp, "wq_a"), lp["q_a_norm"], cfg.rms_eps)


@functools.partial(jax.jit, static_argnames="cfg")
def mlp_norm(cfg: ModelConfig, lp: Params, x: jax.Array) -> jax.Array:
    """The MLP's (or MoE block's) input: rms_norm of the attention residuals x."""
    return rms_norm(x, lp["mlp_norm"], cfg.rms_eps)


@functools.partial(jax.jit, static_argnames="cfg")
def _mlp(cfg: ModelConfig, lp: Params, x_mid: jax.Array) -> jax.Array:
    return mdl.dense_mlp(lp, rms_norm(x_mid, lp["mlp_norm"], cfg.rms_eps), x_mid)


def mlp_outputs(cfg: ModelConfig, lp: Params, x_mid: np.ndarray) -> np.ndarray:
    """A dense-MLP layer's output [N, T, D] for its attention residuals x_mid."""
    return batched(lambda xb, pos: _mlp(cfg, lp, xb), x_mid)


@functools.partial(jax.jit, static_argnames="cfg")
def attention_out(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array,
                  layer: int | None = None) -> jax.Array:
    """wo's input [B, T, Q] for residual stream x (the model's own attention); `layer`: the
    decoder layer (over `total_layers`), whose window a model with sliding layers needs."""
    return mdl.attention_heads(cfg, lp, x, positions, layer)[0]


@functools.partial(jax.jit, static_argnames="cfg")
def _attention_residual(
    cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array, layer: int | None = None
) -> jax.Array:
    return mdl.causal_attention(cfg, lp, x, positions, layer)[0]


@functools.partial(jax.jit, static_argnames="cfg")
def _moe_input(
    cfg: ModelConfig, lp: Params, x_mid: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array]:
    h, routing = mdl.route_layer(cfg, lp, x_mid)
    return h, routing.experts


@functools.partial(jax.jit, static_argnames="cfg")
def _moe(
    cfg: ModelConfig, lp: Params, x_mid: jax.Array, positions: jax.Array, pool: ExpertPool,
    slot_row: jax.Array,
) -> jax.Array:  # fmt: skip
    return mdl.moe_block(cfg, lp, x_mid, pool, slot_row)[0]


def batched(fn: Callable[[np.ndarray, jax.Array], Any], x: np.ndarray) -> Any:
    """fn(x[i:j], positions) over batches of SEQ_BATCH sequences, outputs concatenated (numpy)."""
    outs = []
    for i in range(0, x.shape[0], SEQ_BATCH):
        xb = x[i : i + SEQ_BATCH]
        out = fn(xb, positions_for(*xb.shape[:2]))
        outs.append(tuple(map(np.asarray, out)) if isinstance(out, tuple) else np.asarray(out))
    if isinstance(outs[0], tuple):
        return tuple(np.concatenate(parts) for parts in zip(*outs, strict=True))
    return np.concatenate(outs)


def attention_residuals(cfg: ModelConfig, lp: Params, x: np.ndarray,
                        layer: int | None = None) -> np.ndarray:
    """x + attention(x) [N, T, D]: a layer's first half, `model.causal_attention` (`layer`:
    see `attention_out`)."""
    return batched(lambda xb, pos: _attention_residual(cfg, lp, xb, pos, layer), x)


def moe_inputs(cfg: ModelConfig, lp: Params, x_mid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The MoE block's normed input [N * T, D] and top-k expert ids [N * T, k] (float router),
    by `model.route_layer`."""
    return batched(lambda xb, pos: _moe_input(cfg, lp, xb, pos), x_mid)


def moe_outputs(
    cfg: ModelConfig, lp: Params, x_mid: np.ndarray, pool: ExpertPool, slot_row: jax.Array
) -> np.ndarray:
    """The layer's output [N, T, D]: `model.moe_block` of the attention residuals x_mid."""
    return batched(lambda xb, pos: _moe(cfg, lp, xb, pos, pool, slot_row), x_mid)


@functools.partial(jax.jit, static_argnames="cfg")
def lm_logits(cfg: ModelConfig, globals_: Params, x: jax.Array) -> jax.Array:
    """Final norm + lm_head of hidden states x [..., D] -> float32 logits (`model.lm_head`)."""
    return mdl.lm_head(cfg, globals_, x)


def layer_params(reader: CheckpointReader, layer: int) -> tuple[Params, ExpertPool]:
    """One stored layer as the model uses it: fused dense params and an ExpertPool (slot = id)."""
    lp = fuse_qkv(device_params(reader.read_layer_dense(layer)))
    return lp, ExpertPool(**device_params(dict(reader.iter_layer_experts(layer))))


def mlp_layer_params(reader: CheckpointReader, layer: int) -> Params:
    """Dense-MLP layer `layer`'s params as the model uses them (fused qkv)."""
    return fuse_qkv(device_params(reader.read_mlp_layer(layer)))


def swiglu_hidden(x: np.ndarray, w1: np.ndarray, w3: np.ndarray,
                  biases: tuple[np.ndarray, np.ndarray] | None = None,
                  glu: Glu = SWIGLU) -> np.ndarray:
    """silu(x @ w1) * (x @ w3) in float32 (the down projection's input); biased experts add
    `biases` (b1, b3) and gate by `glu` (GPT-OSS)."""
    gate, up = x @ w1, x @ w3
    if biases is None and glu == SWIGLU:
        return (gate * scipy.special.expit(gate)) * up
    if biases is not None:
        gate, up = gate + biases[0], up + biases[1]
    return np.asarray(glu(jnp.asarray(gate, jnp.float32), jnp.asarray(up, jnp.float32)))


def real_rows(a: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """a [..., C] as token rows [M, C], only those marked in `rows` (bool [M], None: all)."""
    a = a.reshape(-1, a.shape[-1])
    return a if rows is None else a[rows]


def routed_rows(experts: np.ndarray, num_experts: int) -> list[np.ndarray]:
    """For each expert, the token rows whose top-k names it."""
    return [np.nonzero((experts == e).any(axis=-1))[0] for e in range(num_experts)]
