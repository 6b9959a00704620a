"""Post-training quantization of a float Strata checkpoint: int4 experts, int8 dense layers.

`quantize_checkpoint(src, dst, ...)` (CLI: `strata quantize`) reads a float checkpoint one layer
at a time and writes a quantized one (formats of `strata_jax.formats.quant`, see
docs/quantization.md):

* routed experts: int4 g128 by GPTQ (`int4-gptq`) or round-to-nearest (`int4-rtn`);
* dense matrices (`checkpoint.INT8_MATRICES`: wq/wk/wv/wo and the shared expert): int8 per
  output channel by RTN (`int8`) or GPTQ (`int8-gptq`); router, norms, biases and the shared
  gate stay in the model dtype, as do the globals (embeddings, lm_head, final norm).

GPTQ needs each weight's calibration inputs. They come from running calibration sequences
through the model *as it is being quantized*: the hidden states X [N, T, D] (float32) are kept,
and for each layer in turn

    h = rms_norm(X)                    -> Hessian of wq/wk/wv  -> quantize
    o = attention(h) with quantized qkv  -> Hessian of wo        -> quantize
    h2 = rms_norm(X + o @ ŵo)          -> float router picks each token's experts
    per expert: its routed rows of h2  -> Hessian of w1/w3     -> quantize
                silu(x ŵ1) * (x ŵ3)    -> Hessian of w2        -> quantize
    shared expert (qwen2_moe): the same with all rows of h2, int8
    X <- the quantized layer applied to X

so every weight is fitted to the inputs the quantized model will actually feed it. The forward
pieces are the inference functions themselves (`model.causal_attention`, `model.route_layer`,
`model.moe_block`, `model.lm_head`), run in float32 with this layer's params fused as the model
expects them and an ExpertPool of its experts (slot = expert id). An expert
reached by fewer than `min_tokens` calibration tokens (default `gptq.default_min_tokens(K)`)
is rounded to nearest instead, listed in the report and in a `CalibrationWarning` per layer.

Calibration sequences come from a file (.npy int array [N, T], or .json list of token lists of
any lengths) or are sampled from the float model itself (temperature 1, random first tokens),
which loads the *whole float model* resident for the sampling. Either way a `mix_random`
fraction of the sequences are uniform-random tokens, so that rarely routed experts still get
calibration data. Sequences of different lengths are right-padded to the longest one: attention
is causal, so a sequence's real tokens never see its padding, and only real tokens' rows enter
the Hessians and the per-expert token counts.
"""

from __future__ import annotations

import functools
import json
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from strata_jax.api import Model, fuse_qkv, load
from strata_jax.formats import quant
from strata_jax.formats.checkpoint import (
    EXPERT_KINDS,
    FLOAT,
    CheckpointReader,
    CheckpointWriter,
    check_destination,
    expert_arrays,
    expert_shape,
)
from strata_jax.formats.config import ModelConfig
from strata_jax.formats.safe_write import absolute
from strata_jax.formats.tokenizer import copy_tokenizer_files
from strata_jax.model import decoder as mdl
from strata_jax.model.moe import ExpertPool
from strata_jax.ops.layers import rms_norm
from strata_jax.step import programs as step
from strata_jax.tools import gptq

EXPERT_METHODS = ("int4-gptq", "int4-rtn", "none")
DENSE_METHODS = ("int8", "int8-gptq", "none")
REPORT_FILE = "quantize_report.json"
SEQ_BATCH = 16  # calibration sequences per jitted forward call
SAMPLE_BATCH = 64  # sequences sampled at once
CALIB_STREAM, HELDOUT_STREAM = 0, 1  # sampling streams: held-out tokens never repeat calibration
PAD_TOKEN = 0  # right-padding of shorter calibration sequences (never enters any statistic)
WARN_LISTED = 16  # experts named per CalibrationWarning line (the report lists them all)

Params = dict[str, Any]


# ------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class QuantOptions:
    """What to quantize and how; see `quantize_checkpoint`."""

    experts: str = "int4-gptq"
    dense: str = "int8"
    damp: float = 0.01
    act_order: bool = False
    min_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.experts not in EXPERT_METHODS:
            raise ValueError(f"unknown experts method {self.experts!r}; choose {EXPERT_METHODS}")
        if self.dense not in DENSE_METHODS:
            raise ValueError(f"unknown dense method {self.dense!r}; choose {DENSE_METHODS}")
        if not self.damp > 0:
            raise ValueError(f"damp must be > 0, got {self.damp}")
        if self.min_tokens is not None and self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")

    @property
    def needs_calibration(self) -> bool:
        return self.experts == "int4-gptq" or self.dense == "int8-gptq"

    @property
    def storage(self) -> dict[str, str]:
        """The checkpoint's `quantization` entry."""
        return {
            "dense": "none" if self.dense == "none" else "int8",
            "experts": "none" if self.experts == "none" else "int4-g128",
        }

    def gptq_config(self) -> gptq.GPTQConfig:
        return gptq.GPTQConfig(damp=self.damp, act_order=self.act_order, min_tokens=self.min_tokens)


# ------------------------------------------------------------------------------------- report


class CalibrationWarning(UserWarning):
    """GPTQ got too few calibration tokens for some weights, which were rounded to nearest.

    `fallbacks`: (layer, expert id or dense matrix names, calibration tokens) of each.
    """

    def __init__(self, message: str, fallbacks: tuple[tuple[int, int | str, int], ...]) -> None:
        super().__init__(message)
        self.fallbacks = fallbacks


@dataclass(frozen=True)
class ExpertQuant:
    """How one expert was quantized: calibration tokens routed to it, method per w1/w3/w2."""

    layer: int
    expert: int
    tokens: int
    methods: tuple[str, str, str]

    @property
    def method(self) -> str:
        """One of gptq, rtn, none, or mixed (w1/w3 and w2 on different sides of the threshold)."""
        return self.methods[0] if len(set(self.methods)) == 1 else "mixed"

    def to_dict(self) -> dict[str, Any]:
        methods = dict(zip(EXPERT_KINDS, self.methods, strict=True))
        return {**asdict(self), "method": self.method, "methods": methods}


@dataclass(frozen=True)
class QuantReport:
    """Result of `quantize_checkpoint`; `fallbacks` lists (layer, expert, tokens) sent to RTN."""

    src: str
    dst: str
    options: QuantOptions
    calibration: str
    calib_sequences: int
    calib_tokens: int
    experts: tuple[ExpertQuant, ...]
    dense: tuple[tuple[int, str, str], ...]  # (layer, matrix, "gptq" | "rtn" | "none")
    seconds: float

    @property
    def fallbacks(self) -> tuple[tuple[int, int, int], ...]:
        if self.options.experts != "int4-gptq":
            return ()
        return tuple((r.layer, r.expert, r.tokens) for r in self.experts if "rtn" in r.methods)

    def method_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.experts:
            counts[r.method] = counts.get(r.method, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "options": asdict(self.options),
            "calibration": self.calibration,
            "calib_sequences": self.calib_sequences,
            "calib_tokens": self.calib_tokens,
            "expert_methods": self.method_counts(),
            "fallbacks": [list(f) for f in self.fallbacks],
            "experts": [r.to_dict() for r in self.experts],
            "dense": [list(d) for d in self.dense],
            "seconds": self.seconds,
        }

    def __str__(self) -> str:
        o = self.options
        counts = ", ".join(f"{n} {m}" for m, n in sorted(self.method_counts().items()))
        tokens = [r.tokens for r in self.experts]
        lines = [
            f"quantized {self.src} -> {self.dst} in {self.seconds:.1f} s",
            f"  experts: {o.experts} ({counts}); dense: {o.dense}; damp {o.damp}, "
            f"act_order {o.act_order}, min_tokens {o.min_tokens or 'default (2*K)'}",
            f"  calibration: {self.calibration}",
        ]
        if o.needs_calibration and tokens:
            lines.append(
                f"  calibration tokens per expert: min {min(tokens)}, "
                f"median {int(np.median(tokens))}, max {max(tokens)}"
            )
        if self.fallbacks:
            shown = ", ".join(f"L{li}/E{e} ({n} tok)" for li, e, n in self.fallbacks[:12])
            more = len(self.fallbacks) - 12
            lines.append(
                f"  RTN fallback for {len(self.fallbacks)} experts (too few calibration tokens): "
                f"{shown}{f', ... {more} more' if more > 0 else ''}"
            )
        return "\n".join(lines)


# -------------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Calibration:
    """Calibration sequences: int32 [N, T] right-padded with PAD_TOKEN past each of `lengths`."""

    tokens: np.ndarray
    lengths: np.ndarray  # int [N], real tokens per sequence
    description: str

    @property
    def valid(self) -> np.ndarray:
        """bool [N, T]: which positions are real tokens."""
        return np.arange(self.tokens.shape[1]) < self.lengths[:, None]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def pad_sequences(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [N, max length] right-padded with PAD_TOKEN, lengths [N]) of token sequences."""
    lengths = np.array([len(q) for q in seqs], np.int64)
    tokens = np.full((len(seqs), int(lengths.max())), PAD_TOKEN, np.int32)
    for row, q in zip(tokens, seqs, strict=True):
        row[: len(q)] = q
    return tokens, lengths


def parse_calib(spec: str | int) -> str | int:
    """A calibration argument: a sequence count (int or digit string) or a file path."""
    if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        n = int(spec)
        if n < 1:
            raise ValueError(f"calibration needs at least 1 sequence, got {n}")
        return n
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {str(path)!r} not found")
    if path.suffix not in (".npy", ".json"):
        raise ValueError(f"calibration file {path}: expected .npy or .json, got {path.suffix!r}")
    return str(path)


def read_token_sequences(path: str | os.PathLike, vocab_size: int) -> list[np.ndarray]:
    """Token sequences (int32, any lengths) from .npy (int [N, T]) or .json (list of lists)."""
    path = Path(path)
    try:
        seqs = _npy_tokens(path) if path.suffix == ".npy" else _json_tokens(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"token file {path}: unreadable ({e})") from e
    if not seqs:
        raise ValueError(f"token file {path}: no sequences")
    for i, q in enumerate(seqs):
        if q.size == 0:
            raise ValueError(f"token file {path}: sequence {i} is empty")
        if q.min() < 0 or q.max() >= vocab_size:
            raise ValueError(
                f"token file {path}: token ids must be in [0, {vocab_size}), "
                f"got {q.min()}..{q.max()} in sequence {i}"
            )
    return [q.astype(np.int32) for q in seqs]


def read_token_file(path: str | os.PathLike, vocab_size: int) -> np.ndarray:
    """Equal-length token sequences int32 [N, T] from a .npy or .json file (see above)."""
    seqs = read_token_sequences(path, vocab_size)
    lengths = sorted({len(q) for q in seqs})
    if len(lengths) > 1:
        raise ValueError(
            f"token file {path}: sequences must be equal-length here, got lengths "
            f"{lengths[0]}..{lengths[-1]}"
        )
    return np.stack(seqs)


def _npy_tokens(path: Path) -> list[np.ndarray]:
    raw = np.load(path)
    if raw.ndim != 2 or not np.issubdtype(raw.dtype, np.integer):
        raise ValueError(
            f"expected an integer array [sequences, length], got dtype {raw.dtype} "
            f"shape {raw.shape}"
        )
    return list(raw)


def _json_tokens(path: Path) -> list[np.ndarray]:
    data = json.loads(path.read_text())
    if not isinstance(data, list) or not all(isinstance(seq, list) for seq in data):
        raise ValueError("expected a list of token lists")
    for i, seq in enumerate(data):
        bad = next((t for t in seq if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise ValueError(f"sequence {i}: {bad!r} is not a token id (an integer)")
    return [np.asarray(seq, np.int64) for seq in data]


def random_sequences(n: int, length: int, vocab_size: int, seed: int) -> np.ndarray:
    """Uniform-random token sequences int32 [n, length]."""
    return np.random.default_rng([seed, 7]).integers(0, vocab_size, (n, length), np.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "length"))
def _sample_batch(cfg, params, pool, slot_table, first, seeds, length):
    """Temperature-1 continuations of first tokens [B] to [B, length] by the step's sampler;
    row b draws with seed `seeds[b]` (uint32 [B, 2])."""
    b = first.shape[0]
    out = jnp.zeros((b, length), jnp.int32).at[:, 0].set(first)
    tiers = step.resident_tiers(slot_table)
    state = step.init_state(cfg, b, length)
    sampler = state.sampler.replace(temperature=jnp.ones(b, jnp.float32), seed=seeds)
    state = state.replace(tokens=first, live=jnp.ones(b, jnp.bool_), sampler=sampler)
    plan = step.StepPlan(sample=True)

    def body(i, carry):
        out, state = carry
        state, _, _ = step.decode_step(cfg, plan, params, pool, tiers, state)
        return out.at[:, i + 1].set(state.tokens), state

    out, _ = jax.lax.fori_loop(0, length - 1, body, (out, state))
    return out


def check_seed(seed: int) -> None:
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")


def sample_sequences(model: Model, n: int, length: int, seed: int, stream: int) -> np.ndarray:
    """n sequences [n, length] sampled from `model` at temperature 1 from random first tokens.

    `stream` separates calibration (CALIB_STREAM) from held-out tokens (HELDOUT_STREAM), so
    the two never coincide even with the same seed. Batches are padded to SAMPLE_BATCH rows
    (one compilation for any n).
    """
    if length < 1:
        raise ValueError(f"sequence length must be >= 1, got {length}")
    check_seed(seed)
    cfg = model.config
    if n == 0:
        return np.zeros((0, length), np.int32)
    first = np.random.default_rng([seed, stream]).integers(0, cfg.vocab_size, n, np.int32)
    args = (cfg, model.params, model.experts, model.slot_table)
    out = []
    for i in range(0, n, SAMPLE_BATCH):
        batch = np.zeros(SAMPLE_BATCH, np.int32)
        batch[: min(SAMPLE_BATCH, n - i)] = first[i : i + SAMPLE_BATCH]
        seeds = np.random.SeedSequence([seed, stream, i]).generate_state(2 * SAMPLE_BATCH)
        seeds = seeds.reshape(SAMPLE_BATCH, 2)
        out.append(np.asarray(_sample_batch(*args, batch, seeds, length))[: n - i])
    return np.concatenate(out).astype(np.int32)


def calibration_tokens(
    src: str | os.PathLike,
    spec: str | int,
    cfg: ModelConfig,
    calib_len: int = 64,
    mix_random: float = 0.25,
    seed: int = 0,
) -> Calibration:
    """Calibration sequences from a file, or sampled from the float model at `src` (loaded whole).

    A `mix_random` fraction of the returned sequences are uniform-random tokens.
    """
    if not 0 <= mix_random < 1:
        raise ValueError(f"mix_random must be in [0, 1), got {mix_random}")
    spec = parse_calib(spec)
    if isinstance(spec, str):
        return _file_calibration(spec, cfg.vocab_size, mix_random, seed)
    n_rand = round(spec * mix_random)
    sampled = sample_sequences(load(src), spec - n_rand, calib_len, seed, CALIB_STREAM)
    rand = random_sequences(n_rand, calib_len, cfg.vocab_size, seed)
    desc = (
        f"{spec - n_rand} sequences sampled from the float model (temperature 1, seed {seed}) "
        f"+ {n_rand} random sequences, length {calib_len}"
    )
    tokens = np.concatenate([sampled, rand])
    return Calibration(tokens, np.full(len(tokens), calib_len), desc)


def _file_calibration(path: str, vocab_size: int, mix_random: float, seed: int) -> Calibration:
    """A token file's sequences, and random ones taking the file's lengths in turn."""
    data, lengths = pad_sequences(read_token_sequences(path, vocab_size))
    n_rand = round(len(data) * mix_random / (1 - mix_random))
    rand = random_sequences(n_rand, data.shape[1], vocab_size, seed)
    rand_lengths = lengths[np.arange(n_rand) % len(lengths)]
    rand[np.arange(data.shape[1]) >= rand_lengths[:, None]] = PAD_TOKEN
    lo, hi = lengths.min(), lengths.max()
    shape = f"{len(data)} x {hi}" if lo == hi else f"{len(data)} x {lo}..{hi} ({lengths.sum()})"
    desc = f"file {path}: {shape} tokens + {n_rand} random sequences"
    return Calibration(np.concatenate([data, rand]), np.concatenate([lengths, rand_lengths]), desc)


# ----------------------------------------------------------------------- layer forward pieces


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
def _attn_norm(cfg: ModelConfig, lp: Params, x: jax.Array) -> jax.Array:
    return rms_norm(x, lp["attn_norm"], cfg.rms_eps)


@functools.partial(jax.jit, static_argnames="cfg")
@functools.partial(jax.jit, static_argnames="cfg")
def _attention_out(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array):
    """wo's input [B, T, Q] for residual stream x (the model's own attention)."""
    return mdl.attention_heads(cfg, lp, x, positions)[0]


@functools.partial(jax.jit, static_argnames="cfg")
def _attention_residual(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array):
    return mdl.causal_attention(cfg, lp, x, positions)[0]


@functools.partial(jax.jit, static_argnames="cfg")
def _moe_input(cfg: ModelConfig, lp: Params, x_mid: jax.Array, positions: jax.Array):
    h, routing = mdl.route_layer(cfg, lp, x_mid)
    return h, routing.experts


@functools.partial(jax.jit, static_argnames="cfg")
def _moe(cfg: ModelConfig, lp: Params, x_mid, positions, pool: ExpertPool, slot_row):
    return mdl.moe_block(cfg, lp, x_mid, pool, slot_row)[0]


def batched(fn, x: np.ndarray) -> Any:
    """fn(x[i:j], positions) over batches of SEQ_BATCH sequences, outputs concatenated (numpy)."""
    outs = []
    for i in range(0, x.shape[0], SEQ_BATCH):
        xb = x[i : i + SEQ_BATCH]
        out = fn(xb, positions_for(*xb.shape[:2]))
        outs.append(tuple(map(np.asarray, out)) if isinstance(out, tuple) else np.asarray(out))
    if isinstance(outs[0], tuple):
        return tuple(np.concatenate(parts) for parts in zip(*outs, strict=True))
    return np.concatenate(outs)


def attention_residuals(cfg: ModelConfig, lp: Params, x: np.ndarray) -> np.ndarray:
    """x + attention(x) [N, T, D]: a layer's first half, `model.causal_attention`."""
    return batched(lambda xb, pos: _attention_residual(cfg, lp, xb, pos), x)


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


def swiglu_hidden(x: np.ndarray, w1: np.ndarray, w3: np.ndarray) -> np.ndarray:
    """silu(x @ w1) * (x @ w3) in float32 (the down projection's input)."""
    gate = x @ w1
    return (gate * scipy.special.expit(gate)) * (x @ w3)


def real_rows(a: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """a [..., C] as token rows [M, C], only those marked in `rows` (bool [M], None: all)."""
    a = a.reshape(-1, a.shape[-1])
    return a if rows is None else a[rows]


def routed_rows(experts: np.ndarray, num_experts: int) -> list[np.ndarray]:
    """For each expert, the token rows whose top-k names it."""
    return [np.nonzero((experts == e).any(axis=-1))[0] for e in range(num_experts)]


# ------------------------------------------------------------------------------- quantization


def _int8(
    w: np.ndarray, acc: gptq.HessianAccumulator | None, opts: QuantOptions
) -> tuple[quant.Int8Weight, str]:
    """int8 of one dense matrix: GPTQ given enough tokens, else RTN."""
    w = np.asarray(w, np.float32)
    if opts.dense == "int8-gptq" and acc is not None and acc.count > 0:
        if not gptq.needs_rtn_fallback(acc.count, w.shape[0]):
            return gptq.gptq_quantize_int8(w, acc.hessian, opts.damp, opts.act_order), "gptq"
    return quant.quantize_int8(w), "rtn"


def _int4(
    w: np.ndarray, acc: gptq.HessianAccumulator | None, opts: QuantOptions, name: str
) -> tuple[quant.Int4Weight, str]:
    """int4 of one expert matrix: GPTQ given enough routed tokens, else RTN."""
    w = np.asarray(w, np.float32)
    if opts.experts == "int4-rtn" or acc is None or acc.count == 0:
        return quant.quantize_int4_rtn(w, name=name), "rtn"
    return gptq.quantize_expert(w, acc, opts.gptq_config(), name)


def _accumulate(x: np.ndarray) -> gptq.HessianAccumulator:
    return gptq.HessianAccumulator(x.shape[-1]).add(x)


@dataclass
class _LayerState:
    """A layer being quantized: float params in, stored (quantized) params out."""

    layer: int
    stored: dict[str, np.ndarray]
    methods: list[tuple[int, str, str]] = field(default_factory=list)

    def set_int8(self, name: str, weight: quant.Int8Weight, method: str) -> None:
        self.stored[name] = weight.q
        self.stored[f"{name}_scale"] = weight.scales
        self.methods.append((self.layer, name, method))


def _quantize_matrices(
    state: _LayerState,
    names: tuple[str, ...],
    x: np.ndarray | None,
    opts: QuantOptions,
) -> None:
    """int8 of matrices sharing the input x (None: no calibration), as one fused GPTQ problem."""
    if opts.dense == "none":
        state.methods.extend((state.layer, n, "none") for n in names)
        return
    acc = _accumulate(x) if x is not None and opts.dense == "int8-gptq" else None
    ws = [np.asarray(state.stored[n], np.float32) for n in names]
    fused, method = _int8(np.concatenate(ws, axis=-1), acc, opts)
    if opts.dense == "int8-gptq" and method == "rtn":
        _warn_dense_fallback(state.layer, names, acc.count if acc else 0, ws[0].shape[0])
    splits = np.cumsum([w.shape[-1] for w in ws])[:-1]
    for n, q, s in zip(
        names, np.split(fused.q, splits, -1), np.split(fused.scales, splits), strict=True
    ):
        state.set_int8(n, quant.Int8Weight(q, s), method)


def _quantize_experts(
    cfg: ModelConfig,
    layer: int,
    experts: dict[str, np.ndarray],
    h2: np.ndarray | None,
    routes: np.ndarray | None,
    opts: QuantOptions,
) -> tuple[dict[str, np.ndarray], list[ExpertQuant]]:
    """Quantize one layer's experts ([E, in, out] per kind); returns stored arrays + records."""
    num = cfg.num_experts
    rows = routed_rows(routes, num) if routes is not None else [np.zeros(0, np.intp)] * num
    if opts.experts == "none":
        records = [ExpertQuant(layer, e, len(rows[e]), ("none",) * 3) for e in range(num)]
        return experts, records
    def one(e: int) -> tuple[tuple[quant.Int4Weight, ...], ExpertQuant]:
        xe = h2[rows[e]] if h2 is not None else None
        use_x = xe is not None and len(xe) > 0 and opts.experts == "int4-gptq"
        acc_in = _accumulate(xe) if use_x else None
        where = f"layer {layer} expert {e}"
        w1, m1 = _int4(experts["w1"][e], acc_in, opts, f"{where} w1")
        w3, m3 = _int4(experts["w3"][e], acc_in, opts, f"{where} w3")
        acc_mid = None
        if use_x:
            mid = swiglu_hidden(xe, quant.dequantize_int4(w1), quant.dequantize_int4(w3))
            acc_mid = _accumulate(mid)
        w2, m2 = _int4(experts["w2"][e], acc_mid, opts, f"{where} w2")
        return (w1, w3, w2), ExpertQuant(layer, e, len(rows[e]), (m1, m3, m2))

    # round-to-nearest is independent per expert and numpy releases the GIL: use the cores
    workers = min(16, os.cpu_count() or 1) if opts.experts == "int4-rtn" else 1
    with ThreadPoolExecutor(workers) as pool:
        done = list(pool.map(one, range(num)))
    out = {
        k: np.stack([getattr(ws[i], attr) for ws, _ in done])
        for i, kind in enumerate(("w1", "w3", "w2"))
        for k, attr in ((kind, "packed"), (f"{kind}_scale", "scales"))
    }
    return out, [r for _, r in done]


def _pool(experts: dict[str, np.ndarray]) -> ExpertPool:
    """An ExpertPool of one layer's stored experts (slot e = expert e)."""
    return ExpertPool(**device_params(experts))


_SHARED = (("shared_w1", "shared_w3"), ("shared_w2",))  # the shared expert's two GPTQ inputs


class _LayerResult(NamedTuple):
    """One quantized layer: next hidden states (None without calibration), stored arrays."""

    x: np.ndarray | None
    dense: dict[str, np.ndarray]
    experts: dict[str, np.ndarray]  # [E, ...] per stored expert array
    dense_log: list[tuple[int, str, str]]
    records: list[ExpertQuant]


def _quantize_layer(
    cfg32: ModelConfig, reader: CheckpointReader, layer: int, x: np.ndarray | None,
    opts: QuantOptions, rows: np.ndarray | None = None,
) -> _LayerResult:  # fmt: skip
    """Quantize one layer, fitting GPTQ to the inputs x [N, T, D] (None: round to nearest).

    `rows` (bool [N * T], None: all) marks the real tokens of right-padded sequences: only
    they enter the Hessians and the routed token counts.
    """
    state = _LayerState(layer, dict(reader.read_layer_dense(layer)))
    experts = dict(reader.iter_layer_experts(layer))
    if x is None:
        shared = _SHARED if cfg32.has_shared_expert else ()
        for names in (("wq", "wk", "wv"), ("wo",), *shared):
            _quantize_matrices(state, names, None, opts)
        stored, records = _quantize_experts(cfg32, layer, experts, None, None, opts)
        return _LayerResult(None, state.stored, stored, state.methods, records)

    lp = _fused(state)
    h = batched(lambda xb, pos: _attn_norm(cfg32, lp, xb), x)
    _quantize_matrices(state, ("wq", "wk", "wv"), real_rows(h, rows), opts)
    lp = _fused(state)
    del h
    o = batched(lambda xb, pos: _attention_out(cfg32, lp, xb, pos), x)
    _quantize_matrices(state, ("wo",), real_rows(o, rows), opts)
    del o
    lp = _fused(state)
    x_mid = attention_residuals(cfg32, lp, x)
    h2, routes = (real_rows(a, rows) for a in moe_inputs(cfg32, lp, x_mid))
    if cfg32.has_shared_expert:
        _quantize_matrices(state, _SHARED[0], h2, opts)
        mid = None
        if opts.dense == "int8-gptq":
            w1, w3 = (_dense_weight(state.stored, n) for n in _SHARED[0])
            mid = swiglu_hidden(h2, w1, w3)
        _quantize_matrices(state, _SHARED[1], mid, opts)
    stored, records = _quantize_experts(cfg32, layer, experts, h2, routes, opts)
    del h2
    lp, pool = _fused(state), _pool(stored)
    slot_row = jnp.arange(cfg32.num_experts, dtype=jnp.int32)
    x_next = moe_outputs(cfg32, lp, x_mid, pool, slot_row)
    return _LayerResult(x_next, state.stored, stored, state.methods, records)


def _fused(state: _LayerState) -> Params:
    """The layer's current (partly quantized) params as the model expects them (fused qkv)."""
    return fuse_qkv(device_params(state.stored))


def _dense_weight(stored: dict[str, np.ndarray], name: str) -> np.ndarray:
    """A dense matrix as float32, dequantized if it is int8."""
    w = stored[name]
    if f"{name}_scale" in stored:
        return quant.dequantize_int8(quant.Int8Weight(w, stored[f"{name}_scale"]))
    return np.asarray(w, np.float32)


def _threshold(opts: QuantOptions, k: int) -> int:
    """Fewest routed tokens for GPTQ on an input dim of k (as `gptq.needs_rtn_fallback`)."""
    return gptq.default_min_tokens(k) if opts.min_tokens is None else opts.min_tokens


def _warn_dense_fallback(layer: int, names: tuple[str, ...], tokens: int, k: int) -> None:
    matrices = "/".join(names)
    warnings.warn(CalibrationWarning(
        f"layer {layer} {matrices}: int8-gptq needs at least {gptq.default_min_tokens(k)} "
        f"calibration tokens (2 x K, K = {k}), got {tokens}: rounded to nearest instead; "
        "give more calibration data (--calib)", ((layer, matrices, tokens),)), stacklevel=2)


def warn_expert_fallbacks(
    cfg: ModelConfig, records: list[ExpertQuant], opts: QuantOptions
) -> None:
    """One CalibrationWarning for the experts of a layer that GPTQ left to round-to-nearest."""
    fell = [r for r in records if "rtn" in r.methods] if opts.experts == "int4-gptq" else []
    if not fell:
        return
    need = {kind: _threshold(opts, expert_shape(cfg, kind)[0]) for kind in EXPERT_KINDS}
    why = "--min-tokens" if opts.min_tokens is not None else "2 x K"
    need_text = (f"{need['w1']}" if need["w1"] == need["w2"]
                 else f"{need['w1']} for w1/w3 and {need['w2']} for w2")  # fmt: skip
    listed = ", ".join(_fallback_entry(r) for r in fell[:WARN_LISTED])
    more = f", ... and {len(fell) - WARN_LISTED} more" if len(fell) > WARN_LISTED else ""
    warnings.warn(CalibrationWarning(
        f"layer {fell[0].layer}: {len(fell)} of {len(records)} experts got fewer routed "
        f"calibration tokens than GPTQ needs ({need_text}, {why}) and were rounded to nearest: "
        f"{listed}{more}; give more calibration data (--calib) or lower --min-tokens",
        tuple((r.layer, r.expert, r.tokens) for r in fell)), stacklevel=2)  # fmt: skip


def _fallback_entry(r: ExpertQuant) -> str:
    kinds = [k for k, m in zip(EXPERT_KINDS, r.methods, strict=True) if m == "rtn"]
    only = "" if len(kinds) == len(EXPERT_KINDS) else f", {'/'.join(kinds)} only"
    return f"E{r.expert} ({r.tokens} tokens{only})"


# ----------------------------------------------------------------------------------- driver


def single_threaded_blas():
    """Limit numpy's and scipy's BLAS pools to one thread inside the block.

    Quantization makes many small BLAS calls that alternate between numpy (Hessians, SwiGLU
    intermediates) and scipy (GPTQ's Cholesky), between XLA computations; each wheel bundles an
    OpenBLAS whose idle workers spin on the cores the other library and XLA need: on a 2-core
    host a 128 x 128 Cholesky after a numpy matmul took 25-150x longer.
    """
    return threadpool_limits(limits=1, user_api="blas")


def _check_paths(src: Path, dst: Path, overwrite: bool) -> tuple[CheckpointReader, Path]:
    """The float source's reader and the absolute destination, before any work."""
    reader = CheckpointReader(src)
    if reader.quantization != FLOAT:
        raise ValueError(
            f"{src} is already quantized ({reader.quantization}); quantize a float checkpoint"
        )
    return reader, check_destination(dst, overwrite=overwrite, sources=(src,))


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    experts: str = "int4-gptq",
    dense: str = "int8",
    calib: str | int = 64,
    calib_len: int = 64,
    mix_random: float = 0.25,
    damp: float = 0.01,
    act_order: bool = False,
    min_tokens: int | None = None,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool | None = None,
) -> QuantReport:
    """Quantize the float checkpoint `src` into `dst` layer by layer; see the module doc.

    `calib` is a number of sequences to sample from the float model (which loads it whole) or
    a .npy/.json token file. `progress=None` shows the layer bar only on a terminal.
    """
    t0 = time.perf_counter()
    opts = QuantOptions(experts, dense, damp, act_order, min_tokens)
    check_seed(seed)
    if calib_len < 1:
        raise ValueError(f"calib_len must be >= 1, got {calib_len}")
    if not 0 <= mix_random < 1:
        raise ValueError(f"mix_random must be in [0, 1), got {mix_random}")
    src = absolute(src)
    reader, dst = _check_paths(src, Path(dst), overwrite)
    cfg = reader.config
    expert_arrays(cfg, opts.storage)  # the int4 group must fit, before any work
    spec = parse_calib(calib)
    globals_ = reader.read_globals()
    x, cal, rows = None, None, None
    if opts.needs_calibration:
        cal = calibration_tokens(src, spec, cfg, calib_len, mix_random, seed)
        x = np.asarray(globals_["embed"], np.float32)[cal.tokens]
        rows = None if cal.valid.all() else cal.valid.reshape(-1)
    bar = tqdm(range(cfg.num_layers), desc="quantize", unit="layer",
               disable=None if progress is None else not progress)  # fmt: skip
    records: list[ExpertQuant] = []
    dense_log: list[tuple[int, str, str]] = []
    with (
        bar,
        single_threaded_blas(),
        CheckpointWriter(dst, cfg, overwrite=overwrite, quantization=opts.storage,
                         sources=(src,)) as writer,
    ):  # fmt: skip
        writer.write_globals(globals_)
        del globals_
        for layer in bar:
            result = _quantize_layer(cfg.replace(dtype="float32"), reader, layer, x, opts, rows)
            warn_expert_fallbacks(cfg, result.records, opts)
            writer.write_layer_dense(layer, result.dense)
            for kind, arr in result.experts.items():
                for e in range(cfg.num_experts):
                    writer.write_expert(layer, e, kind, arr[e])
            x = result.x
            records += result.records
            dense_log += result.dense_log
        report = QuantReport(
            str(src), str(dst), opts,
            cal.description if cal else "none (round-to-nearest only)",
            len(cal.tokens) if cal else 0, cal.num_tokens if cal else 0,
            tuple(records), tuple(dense_log), time.perf_counter() - t0,
        )  # fmt: skip
        writer.extra = {"quantize": _meta(report, seed, mix_random, calib_len)}
        _write_report(writer.tmp / REPORT_FILE, report)
        copy_tokenizer_files(reader.path, writer)
        writer.commit()
    return report


def _meta(report: QuantReport, seed: int, mix_random: float, calib_len: int) -> dict[str, Any]:
    """The `quantize` entry of the checkpoint's config.json."""
    o = report.options
    return {
        "experts": o.experts,
        "dense": o.dense,
        "calibration": report.calibration,
        "calib_sequences": report.calib_sequences,
        "calib_len": calib_len,
        "mix_random": mix_random,
        "seed": seed,
        "damp": o.damp,
        "act_order": o.act_order,
        "min_tokens": o.min_tokens,
        "expert_methods": report.method_counts(),
        "fallbacks": [list(f) for f in report.fallbacks],
        "source": report.src,
    }


def _write_report(path: Path, report: QuantReport) -> None:
    path.write_text(json.dumps(report.to_dict(), indent=2))
