"""Public, fully resident API: `load`, `logits`, `generate`."""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax import model as mdl
from strata_jax.checkpoint import CheckpointReader
from strata_jax.config import ModelConfig
from strata_jax.moe import ExpertPool


@dataclass(frozen=True)
class Model:
    """A resident model: dense params, an expert pool holding every expert, its slot table."""

    config: ModelConfig
    params: dict[str, Any]
    experts: ExpertPool
    slot_table: jax.Array


def from_arrays(
    config: ModelConfig,
    globals_: dict[str, np.ndarray],
    layers: dict[str, np.ndarray],
    experts: dict[str, np.ndarray],
) -> Model:
    """Build a resident Model from host arrays.

    `layers` maps each dense param name to an array stacked over layers; experts are
    [L, E, in, out] per kind.
    """
    per_layer = [{k: v[i] for k, v in layers.items()} for i in range(config.num_layers)]
    params = dense_params(config, globals_, per_layer)
    return Model(config, params, resident_pool(config, experts), mdl.resident_slot_table(config))


def resident_pool(config: ModelConfig, experts: dict[str, np.ndarray]) -> ExpertPool:
    """Every expert in a slot, [layer * num_experts + expert], from [L, E, ...] arrays."""
    dtype = jnp.dtype(config.dtype)
    flat = {k: _device_array(v, dtype).reshape(-1, *v.shape[2:]) for k, v in experts.items()}
    return ExpertPool(**flat)


def dense_params(
    config: ModelConfig, globals_: dict[str, np.ndarray], layers: list[dict[str, Any]]
) -> dict[str, Any]:
    """Device params the model functions take: globals plus one dict per layer (qkv fused)."""
    dtype = jnp.dtype(config.dtype)
    params: dict[str, Any] = {k: jnp.asarray(v, dtype) for k, v in globals_.items()}
    params["layers"] = tuple(
        fuse_qkv({k: _device_array(v, dtype) for k, v in lp.items()}) for lp in layers
    )
    return params


def read_dense_params(reader: CheckpointReader) -> dict[str, Any]:
    """A checkpoint's dense params on the device, as `dense_params` lays them out."""
    layers = [reader.read_layer_dense(i) for i in range(reader.config.num_layers)]
    return dense_params(reader.config, reader.read_globals(), layers)


def _device_array(v: Any, dtype) -> jax.Array:
    """Float arrays in the model dtype; quantized codes and scales keep their stored dtype."""
    v = np.asarray(v)
    if v.dtype in (np.uint8, np.int8) or v.dtype.name == "bfloat16":
        return jnp.asarray(v)
    return jnp.asarray(v, dtype)


def fuse_qkv(lp: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Replace wq/wk/wv (and biases) by one [D, Q + 2 KV] matrix: one GEMV instead of three."""
    lp = dict(lp)
    for suffix in ("", "_scale"):
        if f"wq{suffix}" in lp:
            parts = [lp.pop(f"w{p}{suffix}") for p in "qkv"]
            lp[f"wqkv{suffix}"] = jnp.concatenate(parts, axis=-1)
    if "bq" in lp:
        lp["bqkv"] = jnp.concatenate([lp.pop("bq"), lp.pop("bk"), lp.pop("bv")], axis=-1)
    return lp


def load(path: str | os.PathLike) -> Model:
    """Load a Strata checkpoint fully resident on the default device, verifying every chunk."""
    reader = CheckpointReader(path)
    cfg = reader.config
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
        experts = {
            kind: _stack_experts(ex, reader, kind, cfg.num_layers, cfg.num_experts)
            for kind in reader.expert_specs
        }
    pool = resident_pool(cfg, experts)
    return Model(cfg, read_dense_params(reader), pool, mdl.resident_slot_table(cfg))


def _stack_experts(ex, reader: CheckpointReader, kind: str, layers: int, experts: int):
    futures = [
        [ex.submit(reader.read_expert, li, e, kind) for e in range(experts)] for li in range(layers)
    ]
    return np.stack([np.stack([f.result() for f in row]) for row in futures])


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(cfg, params, pool, slot_table, tokens):
    return mdl.forward(cfg, params, pool, slot_table, tokens)


def logits(model: Model, tokens: Any) -> np.ndarray:
    """Full causal forward of int32 tokens [B, T] -> numpy float32 logits [B, T, vocab]."""
    tokens = np.asarray(tokens, dtype=np.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
    _check_vocab(model.config, tokens)
    out = _forward(model.config, model.params, model.experts, model.slot_table, tokens)
    return np.asarray(out, dtype=np.float32)


def _check_vocab(cfg: ModelConfig, tokens: np.ndarray) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
        raise ValueError(
            f"token ids must be in [0, {cfg.vocab_size}), got {tokens.min()}..{tokens.max()}"
        )


def bucket(n: int, minimum: int = 8) -> int:
    """Smallest power of two >= max(n, minimum): the prefill length buckets."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg", "max_len"))
def _prefill_first(cfg, params, pool, slot_table, tokens, lengths, max_len):
    all_logits, cache = mdl.prefill(cfg, params, pool, slot_table, tokens, max_len)
    last = all_logits[jnp.arange(tokens.shape[0]), lengths - 1]
    return jnp.argmax(last, axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnames=("cfg", "steps"))
def _greedy_decode(cfg, params, pool, slot_table, cache, first, lengths, steps):
    """`steps` greedy decode steps in one compiled loop; returns tokens [B, steps + 1]."""
    out = jnp.zeros((first.shape[0], steps + 1), jnp.int32).at[:, 0].set(first)

    def body(i, carry):
        out, cache = carry
        step_logits, cache = mdl.decode_step(
            cfg, params, pool, slot_table, cache, out[:, i], lengths + i
        )
        return out.at[:, i + 1].set(jnp.argmax(step_logits, -1).astype(jnp.int32)), cache

    out, cache = jax.lax.fori_loop(0, steps, body, (out, cache))
    return out


def generate(model: Model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy generation through prefill + decode_step; returns only the new tokens."""
    if max_new_tokens < 1:
        return [[] for _ in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and no empty prompt")
    cfg = model.config
    lengths = np.array([len(p) for p in prompts], np.int32)
    t = bucket(int(lengths.max()))
    tokens = np.zeros((len(prompts), t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    _check_vocab(cfg, tokens)
    max_len = bucket(t + max_new_tokens, minimum=64)
    args = (cfg, model.params, model.experts, model.slot_table)
    first, cache = _prefill_first(*args, tokens, lengths, max_len)
    out = _greedy_decode(*args, cache, first, lengths, max_new_tokens - 1)
    return np.asarray(out).tolist()
