"""Public, fully resident API: `load`, `logits`, `generate`."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.batching import requests
from strata_jax.batching.checks import check_request, check_tokens  # noqa: F401 (public)
from strata_jax.batching.resident import ResidentEngine
from strata_jax.batching.scheduler import Scheduler
from strata_jax.batching.scoring import loglikelihood
from strata_jax.batching.text import cut_at_stop
from strata_jax.formats.checkpoint import CheckpointReader, expert_arrays, mixer_counts
from strata_jax.formats.config import F32_PARAMS, ModelConfig
from strata_jax.model import decoder as mdl
from strata_jax.model import mtp as mtp_model
from strata_jax.model.decoder import fuse_qkv
from strata_jax.model.flax_model import MoEModel
from strata_jax.model.moe import ExpertPool
from strata_jax.step import loaded
from strata_jax.step import programs as step
from strata_jax.step.loaded import Model
from strata_jax.step.sampling import GREEDY, SamplingParams


def from_arrays(
    config: ModelConfig,
    globals_: dict[str, np.ndarray],
    layers: dict[str, np.ndarray],
    experts: dict[str, np.ndarray],
    mlp_layers: dict[str, np.ndarray] | None = None,
    mixers: dict[str, dict[str, np.ndarray]] | None = None,
) -> Model:
    """Build a resident Model from host arrays.

    `layers` maps each MoE layer's dense param name to an array stacked over those layers
    (`mlp_layers`: the dense-MLP layers', `ModelConfig.dense_layers`; `mixers`: per kind
    ("attn" / "linear") the token mixers' of a model with linear layers, stacked over that
    kind's layers); experts are [L, E, in, out] per kind.
    """
    def split(stacked: dict[str, np.ndarray] | None, n: int) -> list[dict[str, np.ndarray]]:
        return [{k: v[i] for k, v in (stacked or {}).items()} for i in range(n)]

    per_layer = {k: split((mixers or {}).get(k), n) for k, n in mixer_counts(config).items()}
    params = dense_params(config, globals_, split(layers, config.num_layers),
                          split(mlp_layers, config.dense_layers), per_layer)
    return Model(config, params, resident_pool(config, experts), mdl.resident_slot_table(config))


def resident_pool(config: ModelConfig, experts: dict[str, np.ndarray]) -> ExpertPool:
    """Every expert in a slot, [layer * num_experts + expert], from [L, E, ...] arrays."""
    dtype = jnp.dtype(config.dtype)
    flat = {k: _device_array(v, dtype).reshape(-1, *v.shape[2:]) for k, v in experts.items()}
    return ExpertPool(**flat)


def dense_params(
    config: ModelConfig, globals_: dict[str, np.ndarray], layers: list[dict[str, Any]],
    mlp_layers: Sequence[dict[str, Any]] = (),
    mixers: dict[str, Sequence[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The device param tree of the Flax model (`flax_model.MoEModel`) the step applies:
    {"params": globals + "layers" (+ "mlp_layers" where the model has dense-MLP layers, +
    "attn_layers" and "linear_layers": `mixers`' token mixers of each kind where it has
    linear layers)}, each layer param stacked over its layers (qkv fused)."""
    dtype = jnp.dtype(config.dtype)
    params: dict[str, Any] = {k: jnp.asarray(v, dtype) for k, v in globals_.items()}
    params["layers"] = _stacked(config, layers)
    if config.dense_layers:
        params["mlp_layers"] = _stacked(config, mlp_layers)
    for kind, n in mixer_counts(config).items():
        if n:
            params[f"{kind}_layers"] = _stacked(config, (mixers or {})[kind])
    return {"params": params}


def _stacked(config: ModelConfig, layers: Sequence[dict[str, Any]]) -> dict[str, jax.Array]:
    dtype = jnp.dtype(config.dtype)
    fused = [fuse_qkv({k: np.asarray(v) for k, v in lp.items()}) for lp in layers]
    keep = F32_PARAMS if config.scoring == "sigmoid" else ()
    return {k: _device_array(np.stack([lp[k] for lp in fused]),
                             jnp.float32 if k in keep else dtype) for k in fused[0]}


def init_params(config: ModelConfig, key: jax.Array, dense: str = "none") -> dict[str, Any]:
    """Freshly initialized dense params (`MoEModel.init`), the tree `dense_params` lays out;
    `dense`: "none" or "int8" (int8 matrices with per-channel scales). Experts are no params:
    the one-token forward that `init` traces reads a single zero expert slot."""
    dtype = jnp.dtype(config.dtype)
    pool = ExpertPool(**{k: jnp.zeros((1, *shape), dtype)
                         for k, (shape, _) in expert_arrays(config).items()})
    tiers = step.resident_tiers(jnp.zeros((config.num_layers, config.num_experts), jnp.int32))
    model = MoEModel(config, step.StepPlan(), dense)
    return jax.jit(model.init)(key, jnp.zeros((1, 1), jnp.int32), pool, tiers)


def read_dense_params(reader: CheckpointReader) -> dict[str, Any]:
    """A checkpoint's dense params on the device, as `dense_params` lays them out."""
    cfg = reader.config
    layers = [reader.read_layer_dense(i) for i in range(cfg.num_layers)]
    mlp = [reader.read_mlp_layer(i) for i in range(cfg.dense_layers)]
    mixers = {k: [reader.read_mixer(k, i) for i in range(n)]
              for k, n in mixer_counts(cfg).items()}
    return dense_params(cfg, reader.read_globals(), layers, mlp, mixers)


def _held_dtype(v: np.ndarray, dtype):
    """Float arrays in the model dtype; quantized codes and scales keep their stored dtype."""
    return v.dtype if v.dtype in (np.uint8, np.int8) or v.dtype.name == "bfloat16" else dtype


def _device_array(v: Any, dtype) -> jax.Array:
    v = np.asarray(v)
    return jnp.asarray(v, _held_dtype(v, dtype))


def load(path: str | os.PathLike, expert_devices: int = 1) -> Model:
    """Load a Strata checkpoint fully resident, verifying every chunk: on the default device,
    or with its experts over the first `expert_devices` devices (`expert_parallel`; each
    device receives only its own experts)."""
    reader = CheckpointReader(path)
    cfg = reader.config
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
        experts = {
            kind: _stack_experts(ex, reader, kind, cfg.num_layers, cfg.num_experts)
            for kind in reader.expert_specs
        }
    if expert_devices != 1:
        dtype = jnp.dtype(cfg.dtype)
        host = {k: v.astype(_held_dtype(v, dtype), copy=False) for k, v in experts.items()}
        return loaded.from_host(cfg, read_dense_params(reader), host, expert_devices,
                                 _tokenizer_of(path))
    pool = resident_pool(cfg, experts)
    return Model(cfg, read_dense_params(reader), pool, mdl.resident_slot_table(cfg),
                 _tokenizer_of(path))


def _tokenizer_of(path: str | os.PathLike):
    """The checkpoint's tokenizer, or None when it has none (ids still work)."""
    from strata_jax.formats.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path)
    except FileNotFoundError:
        return None


def _stack_experts(ex, reader: CheckpointReader, kind: str, layers: int, experts: int):
    futures = [
        [ex.submit(reader.read_expert, li, e, kind) for e in range(experts)] for li in range(layers)
    ]
    return np.stack([np.stack([f.result() for f in row]) for row in futures])


class MtpModule(NamedTuple):
    """One multi-token-prediction module on the device (`model/mtp.py`)."""

    params: dict[str, jax.Array]
    """Its dense params, q/k/v fused."""
    experts: ExpertPool
    """Its experts, expert e in slot e."""


def load_mtp(path: str | os.PathLike, index: int = 0) -> MtpModule:
    """Multi-token-prediction module `index` of a checkpoint (`ModelConfig.mtp_layers`)."""
    reader = CheckpointReader(path)
    cfg = reader.config
    if not 0 <= index < cfg.mtp_layers:
        raise ValueError(f"{reader.path}: no MTP module {index} (the checkpoint has "
                         f"{cfg.mtp_layers}; `strata convert hf` keeps the source's)")
    stacked = _stacked(cfg, [reader.read_mtp_layer(index)])
    experts = dict(reader.iter_layer_experts(cfg.num_layers + index))
    dtype = jnp.dtype(cfg.dtype)
    return MtpModule({k: v[0] for k, v in stacked.items()},
                     ExpertPool(**{k: _device_array(v, dtype) for k, v in experts.items()}))


def mtp_logits(model: Model, mtp: MtpModule, tokens: Any) -> np.ndarray:
    """The MTP module's float32 logits [B, T - 1, V] over tokens [B, T]: at position i, its
    guess of token i + 2 from the model's hidden state at i and token i + 1."""
    tokens = np.asarray(tokens, dtype=np.int32)
    check_tokens(model.config, tokens)
    return np.asarray(_mtp_logits(model.config, model.params, model.experts,
                                  step.resident_tiers(model.slot_table), mtp.params,
                                  mtp.experts, tokens))


@functools.partial(jax.jit, static_argnames="cfg")
def _mtp_logits(cfg, params, pool, tiers, mtp_params, mtp_pool, tokens):
    hidden = mtp_model.last_hidden(cfg, params, pool, tiers, tokens)
    return mtp_model.mtp_logits(cfg, params, mtp_params, mtp_pool, hidden[:, :-1],
                                tokens[:, 1:])


def logits(model: Model, tokens: Any) -> np.ndarray:
    """Full causal forward of int32 tokens [B, T] -> numpy float32 logits [B, T, vocab]."""
    return np.asarray(_host(_forward(model, tokens)[0]), dtype=np.float32)


def routing(model: Model, tokens: Any) -> np.ndarray:
    """Every layer's selected experts of the causal forward of tokens [B, T]:
    int32 [layers, B * T, top_k]."""
    return np.asarray(_host(_forward(model, tokens)[1].experts))


def _host(x: jax.Array) -> np.ndarray:
    """A replicated array's value on this host (over several processes, the copy on one of
    this process's devices: every device holds all of it)."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def _forward(model: Model, tokens: Any):
    tokens = np.asarray(tokens, dtype=np.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
    check_tokens(model.config, tokens)
    _, _, forward, tiers = model.programs()
    return forward(model.config, step.StepPlan(), model.params, model.experts, tiers, tokens)


def generate(model: Model, prompts: Sequence[str] | Sequence[Sequence[int]],
             max_new_tokens: int, *, sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
             chat: bool = False, ignore_eos: bool = False, batch_capacity: int = 16,
             max_len: int = 256, prefill_chunk: int | None = None,
             prefill_rows: int | None = None) -> list[str] | list[list[int]]:
    """The continuation of each prompt (up to `max_new_tokens`, ending early at a stop id),
    through the one compiled step and the scheduler's continuous batch (`step.prefill` of a
    request into a free row in chunks of `prefill_chunk` tokens (None:
    `step.default_prefill_chunk`), the chunks of up to `prefill_rows` requests admitted
    together in one program, the running rows riding along (None: `batch_capacity`; 1: a
    prompt's bits never depend on the others'), `step.decode` over `batch_capacity` rows of
    `max_len` positions; a queued prompt takes the row of the first that finishes). `sampling`: one
    SamplingParams for every prompt, or one per prompt. The offload engine with the same
    capacity, length, prefill chunk and rows and seeds gives the same bits.

    Prompts of token ids (lists, or an int array [batch, time]) give the new ids. Text
    prompts (every prompt a str; `chat` applies the model's chat template) go through the
    checkpoint's tokenizer and give text: the model's end-of-sequence ids stop a request
    (unless `ignore_eos`). `sampling.stop`'s strings stop a request where its text first
    holds one (with the checkpoint's tokenizer, id prompts too: the ids end with the token
    that completed it), and text is cut before it."""
    if isinstance(prompts, str | bytes):
        raise TypeError("generate takes a list of prompts, got one string: pass [prompt]")
    if isinstance(prompts, np.ndarray):  # [batch, time] ids: one prompt per row
        if prompts.ndim != 2:
            raise ValueError(f"an array of prompts is [batch, time] ids, got {prompts.shape}")
        prompts = list(prompts)
    if not len(prompts):
        raise ValueError("generate needs at least one prompt")
    if not any(isinstance(p, str) for p in prompts):
        if chat:
            raise ValueError("chat=True needs text prompts (the template applies to text)")
        return _generate_ids(model, prompts, max_new_tokens, sampling, batch_capacity, max_len,
                             prefill_chunk, prefill_rows, model.tokenizer)
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("give every prompt as text or every prompt as token ids, not both")
    from strata_jax.formats.tokenizer import encode_prompts

    tok = model.tokenizer
    ids = encode_prompts(tok, prompts, chat=chat)
    settings = requests.per_request(sampling, len(prompts))
    if not ignore_eos:
        settings = [dataclasses.replace(s, stop_ids=s.stop_ids | tok.eos_ids) for s in settings]
    out = _generate_ids(model, ids, max_new_tokens, settings, batch_capacity, max_len,
                        prefill_chunk, prefill_rows, tok)
    return [cut_at_stop(tok.decode(o), s.stop) for o, s in zip(out, settings, strict=True)]


def _generate_ids(model: Model, prompts, max_new_tokens: int, sampling, batch_capacity: int,
                  max_len: int, prefill_chunk: int | None, prefill_rows: int | None,
                  tokenizer) -> list[list[int]]:

    settings = requests.per_request(sampling, len(prompts))
    for i, p in enumerate(prompts):
        check_request(model.config, i, p, max_new_tokens, max_len)
    sched = Scheduler(ResidentEngine(model, batch_capacity, max_len, prefill_chunk,
                                     prefill_rows), tokenizer)
    reqs = [sched.submit([int(t) for t in p], max_new_tokens, s)
            for p, s in zip(prompts, settings, strict=True)]
    sched.run()
    return [r.tokens for r in reqs]


def score(model: Model, pairs: Sequence[tuple[Any, Any]], *, batch_capacity: int = 16,
          max_len: int = 256, prefill_chunk: int | None = None,
          prefill_rows: int | None = None) -> list:
    """`scoring.Likelihood` of each (context, continuation) pair: ids, or text through the
    checkpoint's tokenizer (each part encoded alone, without special tokens), run as prompts
    through the scheduler like `generate` (same shape knobs). The offload engine's
    `Engine.score` gives the same bits."""

    ids = [tuple(_score_ids(model, part) for part in pair) for pair in pairs]
    sched = Scheduler(ResidentEngine(model, batch_capacity, max_len, prefill_chunk,
                                     prefill_rows))
    return loglikelihood(sched, ids)


def _score_ids(model: Model, part: Any) -> list[int]:
    if not isinstance(part, str):
        return [int(t) for t in np.asarray(part).reshape(-1)]
    if model.tokenizer is None:
        raise ValueError("the checkpoint has no tokenizer; pass ids")
    return model.tokenizer.encode(part, add_special_tokens=False)
