"""Quantize one decoder layer: its dense matrices to int8, its experts to int4 (RTN or GPTQ).

GPTQ needs each weight's calibration inputs. They come from running calibration sequences
through the model *as it is being quantized*: the hidden states X [N, T, D] (float32) are kept,
and for each layer in turn

    h = rms_norm(X)                    -> Hessian of wq/wk/wv  -> quantize
                                          (MLA: of wq_a/wkv_a, then wq_b on its normed q_a)
    o = attention(h) with quantized qkv  -> Hessian of wo        -> quantize
    h2 = rms_norm(X + o @ ŵo)          -> float router picks each token's experts
    per expert: its routed rows of h2  -> Hessian of w1/w3     -> quantize
                silu(x ŵ1) * (x ŵ3)    -> Hessian of w2        -> quantize
    shared expert (qwen2_moe): the same with all rows of h2, int8
    X <- the quantized layer applied to X

A dense-MLP layer (`ModelConfig.dense_layers`, before the MoE layers) goes the same way, its
MLP quantized as a shared expert is.

so every weight is fitted to the inputs the quantized model will actually feed it (the forward
pieces are `layer_forward`'s). An expert reached by fewer than `min_tokens` calibration tokens
(default `gptq.default_min_tokens(K)`) is rounded to nearest instead.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from strata_jax.api import fuse_qkv
from strata_jax.formats import quant
from strata_jax.formats.checkpoint import EXPERT_BIASES, CheckpointReader
from strata_jax.formats.config import ModelConfig
from strata_jax.model.moe import ExpertPool
from strata_jax.ops.expert_kernels import Glu
from strata_jax.tools import gptq
from strata_jax.tools.layer_forward import (
    Params,
    attention_norm,
    attention_out,
    attention_residuals,
    batched,
    device_params,
    mlp_norm,
    mlp_outputs,
    moe_inputs,
    moe_outputs,
    q_lora_input,
    real_rows,
    routed_rows,
    swiglu_hidden,
)
from strata_jax.tools.quant_report import ExpertQuant, QuantOptions, warn_dense_fallback

_SHARED = (("shared_w1", "shared_w3"), ("shared_w2",))  # the shared expert's two GPTQ inputs
_FFN = (("ffn_w1", "ffn_w3"), ("ffn_w2",))  # a dense-MLP layer's MLP, likewise


class LayerResult(NamedTuple):
    """One quantized layer: next hidden states (None without calibration), stored arrays."""

    x: np.ndarray | None
    dense: dict[str, np.ndarray]
    experts: dict[str, np.ndarray]  # [E, ...] per stored expert array
    dense_log: list[tuple[int, str, str]]
    records: list[ExpertQuant]


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


def quantize_layer(
    cfg32: ModelConfig, reader: CheckpointReader, layer: int, x: np.ndarray | None,
    opts: QuantOptions, rows: np.ndarray | None = None,
) -> LayerResult:  # fmt: skip
    """Quantize one layer, fitting GPTQ to the inputs x [N, T, D] (None: round to nearest).

    `rows` (bool [N * T], None: all) marks the real tokens of right-padded sequences: only
    they enter the Hessians and the routed token counts. A `layer` past the MoE layers is
    multi-token-prediction module layer - num_layers (rounded to nearest: x is None).
    """
    mtp = layer - cfg32.num_layers
    dense = reader.read_mtp_layer(mtp) if mtp >= 0 else reader.read_layer_dense(layer)
    state = _LayerState(layer, dict(dense))
    experts = dict(reader.iter_layer_experts(layer))
    x_mid = _quantize_attention(cfg32, state, x, rows, opts, cfg32.dense_layers + layer)
    if x is None:
        for names in _SHARED if cfg32.has_shared_expert else ():
            _quantize_matrices(state, names, None, opts)
        stored, records = _quantize_experts(cfg32, layer, experts, None, None, opts)
        return LayerResult(None, state.stored, stored, state.methods, records)

    lp = _fused(state)
    h2, routes = (real_rows(a, rows) for a in moe_inputs(cfg32, lp, x_mid))
    if cfg32.has_shared_expert:
        _quantize_shared_expert(state, h2, opts)
    stored, records = _quantize_experts(cfg32, layer, experts, h2, routes, opts)
    del h2
    lp, pool = _fused(state), _pool(stored)
    slot_row = jnp.arange(cfg32.num_experts, dtype=jnp.int32)
    x_next = moe_outputs(cfg32, lp, x_mid, pool, slot_row)
    return LayerResult(x_next, state.stored, stored, state.methods, records)


def quantize_mlp_layer(
    cfg32: ModelConfig, reader: CheckpointReader, layer: int, x: np.ndarray | None,
    opts: QuantOptions, rows: np.ndarray | None = None,
) -> LayerResult:  # fmt: skip
    """Quantize dense-MLP layer `layer` (`ModelConfig.dense_layers`): its attention as a MoE
    layer's, its MLP as a shared expert's. Its log names it layer -1 - `layer`."""
    state = _LayerState(-1 - layer, dict(reader.read_mlp_layer(layer)))
    x_mid = _quantize_attention(cfg32, state, x, rows, opts, layer)
    h2 = None
    if x is not None:
        lp = _fused(state)
        h2 = real_rows(batched(lambda xb, pos: mlp_norm(cfg32, lp, xb), x_mid), rows)
    _quantize_matrices(state, _FFN[0], h2, opts)
    mid = None
    if h2 is not None and opts.dense == "int8-gptq":
        mid = swiglu_hidden(h2, *(_dense_weight(state.stored, n) for n in _FFN[0]))
    _quantize_matrices(state, _FFN[1], mid, opts)
    x_next = None if x is None else mlp_outputs(cfg32, _fused(state), x_mid)
    return LayerResult(x_next, state.stored, {}, state.methods, [])


def _attention_groups(cfg: ModelConfig) -> tuple[tuple[str, ...], ...]:
    """The attention's matrices before wo, grouped by their input: the first group reads the
    normed stream; MLA's q_b (with a q-LoRA) the normed q_a output."""
    if cfg.attention != "mla":
        return (("wq", "wk", "wv"),)
    if cfg.q_lora_rank:
        return ("wq_a", "wkv_a"), ("wq_b",)
    return (("wq", "wkv_a"),)


def _quantize_attention(cfg32: ModelConfig, state: _LayerState, x: np.ndarray | None,
                        rows: np.ndarray | None, opts: QuantOptions,
                        decoder_layer: int) -> np.ndarray | None:
    """int8 of the layer's attention matrices, each fitted to the inputs the partly quantized
    layer feeds it; returns the attention residuals x + attention(x) (None without x).
    `decoder_layer`: its index over `total_layers` (a sliding layer's window)."""
    groups = (*_attention_groups(cfg32), ("wo",))
    if x is None:
        for names in groups:
            _quantize_matrices(state, names, None, opts)
        return None
    inputs = {0: attention_norm, 1: q_lora_input}  # the groups before wo
    for i, names in enumerate(groups[:-1]):
        lp = _fused(state)
        h = batched(lambda xb, pos, f=inputs[i], lp=lp: f(cfg32, lp, xb), x)
        _quantize_matrices(state, names, real_rows(h, rows), opts)
        del h
    lp = _fused(state)
    o = batched(lambda xb, pos: attention_out(cfg32, lp, xb, pos, decoder_layer), x)
    _quantize_matrices(state, ("wo",), real_rows(o, rows), opts)
    del o
    return attention_residuals(cfg32, _fused(state), x, decoder_layer)


def _quantize_shared_expert(state: _LayerState, h2: np.ndarray, opts: QuantOptions) -> None:
    """int8 of the shared expert, fitted to all rows h2 of the MoE block's input."""
    _quantize_matrices(state, _SHARED[0], h2, opts)
    mid = None
    if opts.dense == "int8-gptq":
        w1, w3 = (_dense_weight(state.stored, n) for n in _SHARED[0])
        mid = swiglu_hidden(h2, w1, w3)
    _quantize_matrices(state, _SHARED[1], mid, opts)


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
        warn_dense_fallback(state.layer, names, acc.count if acc else 0, ws[0].shape[0])
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
    """Quantize one layer's experts ([E, in, out] per kind); returns stored arrays + records.
    Biased experts keep their biases as they are (floats: `checkpoint.expert_arrays`)."""
    num = cfg.num_experts
    glu = Glu.of(cfg)
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
            biases = (experts["b1"][e], experts["b3"][e]) if cfg.expert_bias else None
            mid = swiglu_hidden(xe, quant.dequantize_int4(w1), quant.dequantize_int4(w3),
                                biases, glu)
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
    out.update({k: experts[k] for k in EXPERT_BIASES if k in experts})
    return out, [r for _, r in done]


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


def _pool(experts: dict[str, np.ndarray]) -> ExpertPool:
    """An ExpertPool of one layer's stored experts (slot e = expert e)."""
    return ExpertPool(**device_params(experts))


def _fused(state: _LayerState) -> Params:
    """The layer's current (partly quantized) params as the model expects them (fused qkv)."""
    return fuse_qkv(device_params(state.stored))


def _dense_weight(stored: dict[str, np.ndarray], name: str) -> np.ndarray:
    """A dense matrix as float32, dequantized if it is int8."""
    w = stored[name]
    if f"{name}_scale" in stored:
        return quant.dequantize_int8(quant.Int8Weight(w, stored[f"{name}_scale"]))
    return np.asarray(w, np.float32)
