"""Post-training quantization of a float Strata checkpoint: int4 experts, int8 dense layers.

`quantize_checkpoint(src, dst, ...)` (CLI: `strata quantize`) reads a float checkpoint one layer
at a time and writes a quantized one (formats of `strata_jax.formats.quant`, see
docs/quantization.md):

* routed experts: int4 g128 by GPTQ (`int4-gptq`) or round-to-nearest (`int4-rtn`);
* dense matrices (`checkpoint.INT8_MATRICES`: wq/wk/wv/wo and the shared expert): int8 per
  output channel by RTN (`int8`) or GPTQ (`int8-gptq`); router, norms, biases and the shared
  gate stay in the model dtype, as do the globals (embeddings, lm_head, final norm).

GPTQ fits each weight to the inputs the quantized model will feed it: calibration sequences
(`calibration`) are run through the model as it is being quantized, layer by layer
(`quantize_layer`, on the forward pieces of `layer_forward`); the multi-token-prediction
modules (`ModelConfig.mtp_layers`) on the last MoE layer's output and each position's next
token, as they run (`mtp.mtp_input`). An expert reached by fewer than
`min_tokens` calibration tokens (default `gptq.default_min_tokens(K)`) is rounded to nearest
instead, listed in the report and in a `CalibrationWarning` per layer (`quant_report`).

This module writes the checkpoint (its config's `quantize` entry and quantize_report.json
beside it) and re-exports the names the tools and tests take from it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from strata_jax.formats.checkpoint import (
    FLOAT,
    CheckpointReader,
    CheckpointWriter,
    check_destination,
    expert_arrays,
)
from strata_jax.formats.config import ModelConfig
from strata_jax.formats.safe_write import absolute
from strata_jax.formats.tokenizer import copy_tokenizer_files
from strata_jax.model.mtp import mtp_input
from strata_jax.tools.calibration import (
    CALIB_STREAM,
    HELDOUT_STREAM,
    PAD_TOKEN,
    SAMPLE_BATCH,
    Calibration,
    calibration_tokens,
    check_seed,
    pad_sequences,
    parse_calib,
    random_sequences,
    read_token_file,
    read_token_sequences,
    sample_sequences,
)
from strata_jax.tools.layer_forward import (
    SEQ_BATCH,
    Params,
    attention_residuals,
    batched,
    device_params,
    layer_params,
    lm_logits,
    moe_inputs,
    moe_outputs,
    positions_for,
    real_rows,
    routed_rows,
    swiglu_hidden,
)
from strata_jax.tools.quant_report import (
    DENSE_METHODS,
    EXPERT_METHODS,
    WARN_LISTED,
    CalibrationWarning,
    ExpertQuant,
    QuantOptions,
    QuantReport,
    warn_expert_fallbacks,
)
from strata_jax.tools.quantize_layer import quantize_layer, quantize_mlp_layer

__all__ = [
    "CALIB_STREAM", "DENSE_METHODS", "EXPERT_METHODS", "HELDOUT_STREAM", "PAD_TOKEN",
    "REPORT_FILE", "SAMPLE_BATCH", "SEQ_BATCH", "WARN_LISTED", "Calibration",
    "CalibrationWarning", "ExpertQuant", "Params", "QuantOptions", "QuantReport",
    "attention_residuals", "batched", "calibration_tokens", "check_seed", "device_params",
    "layer_params", "lm_logits", "moe_inputs", "moe_outputs", "pad_sequences", "parse_calib",
    "positions_for", "quantize_checkpoint", "quantize_entry", "random_sequences",
    "read_token_file", "read_token_sequences", "real_rows", "routed_rows", "sample_sequences",
    "single_threaded_blas", "swiglu_hidden", "warn_expert_fallbacks", "write_report",
]  # fmt: skip

REPORT_FILE = "quantize_report.json"


def single_threaded_blas() -> threadpool_limits:
    """Limit numpy's and scipy's BLAS pools to one thread inside the block.

    Quantization makes many small BLAS calls that alternate between numpy (Hessians, SwiGLU
    intermediates) and scipy (GPTQ's Cholesky), between XLA computations; each wheel bundles an
    OpenBLAS whose idle workers spin on the cores the other library and XLA need: on a 2-core
    host a 128 x 128 Cholesky after a numpy matmul took 25-150x longer.
    """
    return threadpool_limits(limits=1, user_api="blas")


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
        if cfg.mtp_layers:  # the MTP modules' inputs: each position's next token too
            mtp_cal = _MtpCalibration(x[:, 1:], cal.valid[:, 1:])
    bar = tqdm(range(cfg.num_layers + cfg.mtp_layers), desc="quantize", unit="layer",
               disable=None if progress is None else not progress)  # fmt: skip
    records: list[ExpertQuant] = []
    dense_log: list[tuple[int, str, str]] = []  # dense-MLP layer i logged as layer -1 - i
    with (
        bar,
        single_threaded_blas(),
        CheckpointWriter(dst, cfg, overwrite=overwrite, quantization=opts.storage,
                         sources=(src,)) as writer,
    ):  # fmt: skip
        writer.write_globals(globals_)
        del globals_
        cfg32 = cfg.replace(dtype="float32")
        for layer in range(cfg.dense_layers):
            result = quantize_mlp_layer(cfg32, reader, layer, x, opts, rows)
            writer.write_mlp_layer(layer, result.dense)
            x, dense_log = result.x, dense_log + result.dense_log
        for layer in bar:  # the MoE layers, then the MTP modules on the last layer's output
            mtp = layer - cfg.num_layers
            if mtp >= 0 and x is not None:
                result = quantize_layer(cfg32, reader, layer, mtp_cal.input(
                    cfg32, reader.read_mtp_layer(mtp), x), opts, mtp_cal.rows)
            else:
                result = quantize_layer(cfg32, reader, layer, x, opts, rows)
            if mtp >= 0:
                writer.write_mtp_layer(mtp, result.dense)
            else:
                warn_expert_fallbacks(cfg, result.records, opts)
                writer.write_layer_dense(layer, result.dense)
                x = result.x
            for kind, arr in result.experts.items():
                for e in range(cfg.num_experts):
                    writer.write_expert(layer, e, kind, arr[e])
            records += result.records
            dense_log += result.dense_log
        report = QuantReport(
            str(src), str(dst), opts,
            cal.description if cal else "none (round-to-nearest only)",
            len(cal.tokens) if cal else 0, cal.num_tokens if cal else 0,
            tuple(records), tuple(dense_log), time.perf_counter() - t0,
        )  # fmt: skip
        writer.extra = {"quantize": quantize_entry(
            report, calib_len=calib_len, mix_random=mix_random, seed=seed)}  # fmt: skip
        write_report(writer.tmp / REPORT_FILE, report)
        copy_tokenizer_files(reader.path, writer)
        writer.commit()
    return report


class _MtpCalibration(NamedTuple):
    """What an MTP module's calibration reads besides the model's last hidden states: the
    embeddings of each position's next token [N, T - 1, D], and which positions are real (a
    position and its next token both: the sequences are right-padded)."""

    embedded: np.ndarray
    valid: np.ndarray

    @property
    def rows(self) -> np.ndarray | None:
        return None if self.valid.all() else self.valid.reshape(-1)

    def input(self, cfg32: ModelConfig, dense: dict[str, np.ndarray], x: np.ndarray
              ) -> np.ndarray:
        """The module's decoder-layer input [N, T - 1, D] (`mtp.mtp_input`, its float params
        `dense`: the norms and `eh_proj` are never quantized) from the last MoE layer's
        output x [N, T, D], as the module runs on the model it follows."""
        params = {k: jnp.asarray(dense[k], jnp.float32) for k in ("enorm", "hnorm", "eh_proj")}
        return np.asarray(mtp_input(cfg32, params, self.embedded, x[:, :-1]), np.float32)


def _check_paths(src: Path, dst: Path, overwrite: bool) -> tuple[CheckpointReader, Path]:
    """The float source's reader and the absolute destination, before any work."""
    reader = CheckpointReader(src)
    if reader.quantization != FLOAT:
        raise ValueError(
            f"{src} is already quantized ({reader.quantization}); quantize a float checkpoint"
        )
    return reader, check_destination(dst, overwrite=overwrite, sources=(src,))


def quantize_entry(report: QuantReport, **sampling: Any) -> dict[str, Any]:
    """The `quantize` entry of the checkpoint's config.json (also `strata convert hf`'s);
    `sampling`: how calibration sequences were made (calib_len, mix_random, seed)."""
    o = report.options
    return {
        "experts": o.experts,
        "dense": o.dense,
        "calibration": report.calibration,
        "calib_sequences": report.calib_sequences,
        **sampling,
        "damp": o.damp,
        "act_order": o.act_order,
        "min_tokens": o.min_tokens,
        "expert_methods": report.method_counts(),
        "fallbacks": [list(f) for f in report.fallbacks],
        "source": report.src,
    }


def write_report(path: Path, report: QuantReport) -> None:
    path.write_text(json.dumps(report.to_dict(), indent=2))
