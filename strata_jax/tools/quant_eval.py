"""How much a quantized checkpoint loses against its float source (`strata eval quant`).

On held-out tokens (sequences sampled from the float model on a stream that calibration never
uses, plus optionally a token file):

(a) per expert, the relative output error ‖f(x) − f̂(x)‖ / ‖f(x)‖ of its SwiGLU on the held-out
    tokens routed to it (float model's layer inputs and router), for round-to-nearest int4
    computed on the fly from the float weights, and for the checkpoint's (e.g. GPTQ) weights;
(b) KL(float ‖ quantized) of the next-token distributions, mean over all held-out positions,
    and top-1 agreement of the two models;
(c) bytes per expert and per tier: float vs quantized bytes of one expert, of one layer's dense
    params, and totals per component (embeddings/lm_head, dense layers, experts). Experts are
    what an offloading runtime keeps in host RAM / NVMe tiers; dense params and globals stay
    in HBM.

Sampling the held-out sequences loads the float model whole (resident). The comparison then
streams both checkpoints one layer at a time through the inference layer functions in float32
(`quantize.attention_residuals` / `moe_inputs` / `moe_outputs`, i.e. `model.causal_attention`,
`model.route_layer`, `model.moe_block`), so KL and top-1 measure quantization error only, not
bfloat16 compute error, and the quantized model routes its own hidden states with its router.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import scipy.special

from strata_jax import api
from strata_jax.formats import quant
from strata_jax.formats.checkpoint import (
    EXPERT_KINDS,
    FLOAT,
    CheckpointReader,
    global_shapes,
    numpy_dtype,
)
from strata_jax.model.moe import ExpertPool
from strata_jax.ops.expert_kernels import SWIGLU, Glu
from strata_jax.tools.layer_forward import mlp_layer_params, mlp_outputs
from strata_jax.tools.quantize import (
    HELDOUT_STREAM,
    SEQ_BATCH,
    attention_residuals,
    device_params,
    layer_params,
    lm_logits,
    moe_inputs,
    moe_outputs,
    read_token_file,
    routed_rows,
    sample_sequences,
    single_threaded_blas,
    swiglu_hidden,
)

HBM, OFFLOAD = "HBM", "offload (host RAM / NVMe)"
MIN_EXPERT_TOKENS = 32


@dataclass(frozen=True)
class ExpertError:
    """Held-out relative SwiGLU output error of one expert; None where too few tokens."""

    layer: int
    expert: int
    tokens: int
    rtn: float | None
    quantized: float | None

    @property
    def ratio(self) -> float | None:
        if self.rtn is None or self.quantized is None or self.rtn == 0:
            return None
        return self.quantized / self.rtn


@dataclass(frozen=True)
class BytesRow:
    """Stored bytes of one component in the float and the quantized checkpoint."""

    component: str
    tier: str
    float_bytes: int
    quant_bytes: int

    @property
    def ratio(self) -> float:
        return self.float_bytes / self.quant_bytes if self.quant_bytes else math.inf


@dataclass(frozen=True)
class QuantEval:
    """Result of `evaluate_quantization`."""

    ckpt: str
    ref: str
    quantization: dict[str, str]
    heldout: str
    positions: int
    kl_mean: float
    top1: float
    experts: tuple[ExpertError, ...]
    bytes: tuple[BytesRow, ...]
    min_expert_tokens: int
    seconds: float

    @property
    def evaluated(self) -> tuple[ExpertError, ...]:
        """Experts with at least `min_expert_tokens` held-out tokens."""
        return tuple(e for e in self.experts if e.ratio is not None)

    @property
    def better_fraction(self) -> float:
        """Fraction of evaluated experts whose checkpoint error is below RTN's."""
        ev = self.evaluated
        return sum(e.ratio < 1 for e in ev) / len(ev) if ev else math.nan

    @property
    def mean_ratio(self) -> float:
        ev = self.evaluated
        return float(np.mean([e.ratio for e in ev])) if ev else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {
            "ckpt": self.ckpt,
            "ref": self.ref,
            "quantization": self.quantization,
            "heldout": self.heldout,
            "positions": self.positions,
            "kl_mean": self.kl_mean,
            "top1_agreement": self.top1,
            "experts": {
                "evaluated": len(self.evaluated),
                "total": len(self.experts),
                "min_tokens": self.min_expert_tokens,
                "better_than_rtn_fraction": self.better_fraction,
                "mean_error_ratio": self.mean_ratio,
                "mean_rtn_error": _mean([e.rtn for e in self.evaluated]),
                "mean_quantized_error": _mean([e.quantized for e in self.evaluated]),
                "per_expert": [asdict(e) for e in self.experts],
            },
            "bytes": [{**asdict(r), "ratio": r.ratio} for r in self.bytes],
            "seconds": self.seconds,
        }

    def table(self) -> str:
        """Human-readable summary: model agreement, expert errors, bytes per expert and tier."""
        ev = self.evaluated
        lines = [
            f"{self.ckpt} ({self.quantization}) vs float {self.ref}",
            f"held-out: {self.heldout}",
            f"logits over {self.positions} positions: KL(float || quantized) mean "
            f"{self.kl_mean:.4g} nats, top-1 agreement {100 * self.top1:.2f} %",
            f"expert SwiGLU output error on held-out routed tokens ({len(ev)}/"
            f"{len(self.experts)} experts with >= {self.min_expert_tokens} tokens): "
            f"RTN {_mean([e.rtn for e in ev]):.4f}, checkpoint "
            f"{_mean([e.quantized for e in ev]):.4f}, mean ratio {self.mean_ratio:.3f}, "
            f"checkpoint better for {100 * self.better_fraction:.1f} %",
            "",
            f"{'component':<28}{'tier':<28}{'float':>14}{'quantized':>14}{'ratio':>8}",
        ]
        for r in self.bytes:
            lines.append(
                f"{r.component:<28}{r.tier:<28}{r.float_bytes:>14,}{r.quant_bytes:>14,}"
                f"{r.ratio:>7.2f}x"
            )
        return "\n".join(lines)


def _mean(values: list[float | None]) -> float:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else math.nan


# ------------------------------------------------------------------------------------- bytes


def _spec_bytes(specs: dict[str, tuple[tuple[int, ...], str]]) -> int:
    return sum(math.prod(shape) * numpy_dtype(dtype).itemsize for shape, dtype in specs.values())


def _global_bytes(reader: CheckpointReader) -> int:
    cfg = reader.config
    item = numpy_dtype(cfg.dtype).itemsize
    return sum(math.prod(s) for s in global_shapes(cfg).values()) * item


def bytes_table(ref: CheckpointReader, ckpt: CheckpointReader) -> tuple[BytesRow, ...]:
    """Bytes per expert and per tier of the float `ref` and the quantized `ckpt`."""
    cfg = ref.config
    layers, experts = cfg.num_layers, cfg.num_layers * cfg.num_experts
    g = (_global_bytes(ref), _global_bytes(ckpt))
    d = (_spec_bytes(ref.dense_specs), _spec_bytes(ckpt.dense_specs))
    e = (_spec_bytes(ref.expert_specs), _spec_bytes(ckpt.expert_specs))
    per_kind = [
        BytesRow(f"  expert {kind}", OFFLOAD, *(_spec_bytes(
            {k: v for k, v in r.expert_specs.items() if k in (kind, f"{kind}_scale")}
        ) for r in (ref, ckpt)))
        for kind in EXPERT_KINDS
    ]  # fmt: skip
    mlp = tuple(cfg.dense_layers * _spec_bytes(r.mlp_specs) for r in (ref, ckpt))
    hbm = (g[0] + layers * d[0] + mlp[0], g[1] + layers * d[1] + mlp[1])
    off = (experts * e[0], experts * e[1])
    mlp_row = ((BytesRow(f"dense-MLP layers (x{cfg.dense_layers})", HBM, *mlp),)
               if cfg.dense_layers else ())
    return (
        BytesRow("per expert (w1+w3+w2)", OFFLOAD, *e),
        *per_kind,
        BytesRow("per layer dense", HBM, *d),
        BytesRow("embeddings/lm_head/norm", HBM, *g),
        BytesRow(f"dense layers (x{layers})", HBM, layers * d[0], layers * d[1]),
        *mlp_row,
        BytesRow(f"experts (x{experts})", OFFLOAD, *off),
        BytesRow("tier total: HBM", HBM, *hbm),
        BytesRow("tier total: offload", OFFLOAD, *off),
        BytesRow("total", "-", hbm[0] + off[0], hbm[1] + off[1]),
    )


# ------------------------------------------------------------------- streamed comparison


def kl_top1(p_logits: np.ndarray, q_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-position KL(p || q) in nats and whether the argmaxes agree; logits [..., V]."""
    logp = scipy.special.log_softmax(np.asarray(p_logits, np.float64), axis=-1)
    logq = scipy.special.log_softmax(np.asarray(q_logits, np.float64), axis=-1)
    kl = np.sum(np.exp(logp) * (logp - logq), axis=-1)
    return kl, p_logits.argmax(-1) == q_logits.argmax(-1)


def _expert_weights(pool: ExpertPool, e: int) -> dict[str, np.ndarray]:
    """Expert e of a one-layer host pool as float32 [in, out] weights (dequantized if int4)."""
    out = {}
    for k in EXPERT_KINDS:
        w = getattr(pool, k)[e]
        if pool.quantized:
            w = quant.dequantize_int4(quant.Int4Weight(w, getattr(pool, f"{k}_scale")[e]))
        out[k] = np.asarray(w, np.float32)
    return out


def _host_pool(pool: ExpertPool) -> ExpertPool:
    """The pool's arrays as numpy (slicing them then dispatches no device work)."""
    return ExpertPool(*(None if a is None else np.asarray(a) for a in pool))


def _expert_biases(pool: ExpertPool, e: int) -> tuple[np.ndarray, ...] | None:
    """Expert e's (b1, b3, b2) as float32, or None for unbiased experts."""
    if not pool.biased:
        return None
    return tuple(np.asarray(getattr(pool, k)[e], np.float32) for k in ("b1", "b3", "b2"))


def _swiglu(x: np.ndarray, w: dict[str, np.ndarray], biases=None, glu: Glu = SWIGLU) -> np.ndarray:
    if biases is None:
        return swiglu_hidden(x, w["w1"], w["w3"], None, glu) @ w["w2"]
    return swiglu_hidden(x, w["w1"], w["w3"], biases[:2], glu) @ w["w2"] + biases[2]


def _rel_err(ref: np.ndarray, got: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def layer_expert_errors(
    layer: int, h2: np.ndarray, routes: np.ndarray, ref: ExpertPool, ckpt: ExpertPool,
    min_tokens: int, glu: Glu = SWIGLU,
) -> list[ExpertError]:  # fmt: skip
    """Held-out SwiGLU errors of RTN and of the checkpoint for each expert of one layer
    (biased experts with their biases, which neither rounds, and gated by `glu`)."""
    out = []
    for e, rows in enumerate(routed_rows(routes, ref.num_slots)):
        if len(rows) < min_tokens:
            out.append(ExpertError(layer, e, len(rows), None, None))
            continue
        xe, w, b = h2[rows], _expert_weights(ref, e), _expert_biases(ref, e)
        w_rtn = {k: quant.dequantize_int4(quant.quantize_int4_rtn(v)) for k, v in w.items()}
        f, w_q = _swiglu(xe, w, b, glu), _expert_weights(ckpt, e)
        rtn = _rel_err(f, _swiglu(xe, w_rtn, b, glu))
        got = _rel_err(f, _swiglu(xe, w_q, _expert_biases(ckpt, e), glu))
        out.append(ExpertError(layer, e, len(rows), rtn, got))
    return out


def _through_mlp_layers(cfg, reader: CheckpointReader, x: np.ndarray) -> np.ndarray:
    """x through the dense-MLP layers (`ModelConfig.dense_layers`, before the MoE layers,
    with no experts to compare)."""
    for layer in range(cfg.dense_layers):
        lp = mlp_layer_params(reader, layer)
        x = mlp_outputs(cfg, lp, attention_residuals(cfg, lp, x, layer))
    return x


def compare_streamed(
    ref: CheckpointReader, ckpt: CheckpointReader, tokens: np.ndarray, min_tokens: int
) -> tuple[tuple[ExpertError, ...], float, float]:
    """(per-expert errors, mean KL, top-1 agreement) of `ckpt` against `ref` on tokens [N, T].

    Both models run layer by layer in float32 through the inference layer function (one layer
    of each in memory); expert inputs and routing are the float model's.
    """
    cfg = ref.config.replace(dtype="float32")
    g_ref, g_q = device_params(ref.read_globals()), device_params(ckpt.read_globals())
    x_ref = np.asarray(g_ref["embed"])[tokens]
    x_q = np.asarray(g_q["embed"])[tokens]
    slots = jnp.arange(cfg.num_experts, dtype=jnp.int32)
    errors: list[ExpertError] = []
    x_ref, x_q = _through_mlp_layers(cfg, ref, x_ref), _through_mlp_layers(cfg, ckpt, x_q)
    for layer in range(cfg.num_layers):
        lp_ref, pool_ref = layer_params(ref, layer)
        lp_q, pool_q = layer_params(ckpt, layer)
        x_ref = attention_residuals(cfg, lp_ref, x_ref, cfg.dense_layers + layer)
        h2, routes = moe_inputs(cfg, lp_ref, x_ref)
        np_ref, np_q = _host_pool(pool_ref), _host_pool(pool_q)
        errors += layer_expert_errors(layer, h2, routes, np_ref, np_q, min_tokens,
                                      Glu.of(cfg))
        del h2
        x_ref = moe_outputs(cfg, lp_ref, x_ref, pool_ref, slots)
        x_q = attention_residuals(cfg, lp_q, x_q, cfg.dense_layers + layer)
        x_q = moe_outputs(cfg, lp_q, x_q, pool_q, slots)
    kls, agree = [], []
    for i in range(0, len(tokens), SEQ_BATCH):
        p = np.asarray(lm_logits(cfg, g_ref, x_ref[i : i + SEQ_BATCH]))
        q = np.asarray(lm_logits(cfg, g_q, x_q[i : i + SEQ_BATCH]))
        kl, top1 = kl_top1(p, q)
        kls.append(kl.ravel())
        agree.append(top1.ravel())
    return tuple(errors), float(np.concatenate(kls).mean()), float(np.concatenate(agree).mean())


# ------------------------------------------------------------------------------------ driver


def heldout_tokens(
    ref: str | os.PathLike, n: int, length: int, seed: int,
    token_file: str | os.PathLike | None = None,
) -> tuple[np.ndarray, str]:  # fmt: skip
    """Held-out sequences sampled from the float model at `ref` (loaded whole; held-out
    stream), plus a token file's."""
    parts, desc = [], []
    vocab = CheckpointReader(ref).config.vocab_size
    if n > 0:
        parts.append(sample_sequences(api.load(ref), n, length, seed, HELDOUT_STREAM))
        desc.append(f"{n} x {length} tokens sampled from the float model (seed {seed})")
    if token_file is not None:
        data = read_token_file(token_file, vocab)
        if parts and data.shape[1] != length:
            raise ValueError(
                f"token file {token_file}: length {data.shape[1]} != --seq-len {length}"
            )
        parts.append(data)
        desc.append(f"{len(data)} x {data.shape[1]} tokens from {token_file}")
    if not parts:
        raise ValueError("no held-out tokens: pass --tokens N > 0 or a token file")
    return np.concatenate(parts), " + ".join(desc)


def evaluate_quantization(
    ckpt: str | os.PathLike,
    ref: str | os.PathLike,
    *,
    tokens: int = 32,
    seq_len: int = 64,
    seed: int = 0,
    token_file: str | os.PathLike | None = None,
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
) -> QuantEval:
    """Compare quantized `ckpt` with its float source `ref`; see the module doc.

    Sampling the held-out sequences loads the float model whole; the comparison itself then
    streams both checkpoints one layer at a time.
    """
    t0 = time.perf_counter()
    q_reader, f_reader = CheckpointReader(ckpt), CheckpointReader(ref)
    if f_reader.quantization != FLOAT:
        raise ValueError(f"--ref {ref} must be a float checkpoint, it is {f_reader.quantization}")
    if q_reader.config != f_reader.config:
        raise ValueError(f"{ckpt} and {ref} are not the same model (configs differ)")
    held, desc = heldout_tokens(ref, tokens, seq_len, seed, token_file)
    with single_threaded_blas():
        errors, kl, top1 = compare_streamed(f_reader, q_reader, held, min_expert_tokens)
    return QuantEval(
        str(ckpt), str(ref), q_reader.quantization, desc, int(held.size), kl, top1, errors,
        bytes_table(f_reader, q_reader), min_expert_tokens, time.perf_counter() - t0,
    )  # fmt: skip


def write_json(result: QuantEval, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(result.to_dict(), indent=2))
