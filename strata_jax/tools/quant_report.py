"""What `strata quantize` is asked to do and what came of it.

`QuantOptions` (the methods for experts and dense matrices, GPTQ's damping, act-order and token
threshold), `ExpertQuant` (how one expert was quantized), `QuantReport` (the whole run, as
printed and as written to quantize_report.json) and `CalibrationWarning`, raised (as a warning)
where GPTQ had too few calibration tokens and a weight was rounded to nearest instead.

`strata convert hf --experts int4-rtn` writes the same report, with each expert's
`weight_error` against its source: no float checkpoint is left for `strata eval quant`.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from strata_jax.formats import quant
from strata_jax.formats.checkpoint import EXPERT_KINDS, expert_shape
from strata_jax.formats.config import ModelConfig
from strata_jax.tools import gptq

EXPERT_METHODS = ("int4-gptq", "int4-rtn", "none")
DENSE_METHODS = ("int8", "int8-gptq", "none")
WARN_LISTED = 16  # experts named per CalibrationWarning line (the report lists them all)


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


class CalibrationWarning(UserWarning):
    """GPTQ got too few calibration tokens for some weights, which were rounded to nearest.

    `fallbacks`: (layer, expert id or dense matrix names, calibration tokens) of each.
    """

    def __init__(self, message: str, fallbacks: tuple[tuple[int, int | str, int], ...]) -> None:
        super().__init__(message)
        self.fallbacks = fallbacks


def weight_error(w: np.ndarray, q: quant.Int4Weight) -> float:
    """‖W − Ŵ‖ / ‖W‖ (Frobenius) of int4 `q` against its float source `w` (0 where w = 0)."""
    w = np.asarray(w, np.float32)
    norm = float(np.linalg.norm(w))
    return float(np.linalg.norm(quant.dequantize_int4(q) - w)) / norm if norm else 0.0


@dataclass(frozen=True)
class ExpertQuant:
    """How one expert was quantized: calibration tokens routed to it, method per w1/w3/w2, and
    `weight_error` (per w1/w3/w2) where the quantizer measured it (`strata convert hf`)."""

    layer: int
    expert: int
    tokens: int
    methods: tuple[str, str, str]
    weight_error: tuple[float, float, float] | None = None

    @property
    def method(self) -> str:
        """One of gptq, rtn, none, or mixed (w1/w3 and w2 on different sides of the threshold)."""
        return self.methods[0] if len(set(self.methods)) == 1 else "mixed"

    def to_dict(self) -> dict[str, Any]:
        methods = dict(zip(EXPERT_KINDS, self.methods, strict=True))
        out = {**asdict(self), "method": self.method, "methods": methods}
        if self.weight_error is None:
            del out["weight_error"]
        else:
            out["weight_error"] = dict(zip(EXPERT_KINDS, self.weight_error, strict=True))
        return out


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

    def weight_errors(self) -> dict[str, Any] | None:
        """Mean and largest expert weight error and where the largest is; None unmeasured."""
        rows = [(err, r.layer, r.expert, kind) for r in self.experts if r.weight_error
                for kind, err in zip(EXPERT_KINDS, r.weight_error, strict=True)]  # fmt: skip
        if not rows:
            return None
        worst = max(rows)
        return {"mean": float(np.mean([e for e, *_ in rows])), "max": worst[0],
                "max_at": {"layer": worst[1], "expert": worst[2], "kind": worst[3]}}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        errors = self.weight_errors()
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
            **({"weight_error": errors} if errors else {}),
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


def warn_dense_fallback(layer: int, names: tuple[str, ...], tokens: int, k: int) -> None:
    """A CalibrationWarning for dense matrices that int8-gptq left to round-to-nearest."""
    matrices = "/".join(names)
    warnings.warn(
        CalibrationWarning(
            f"layer {layer} {matrices}: int8-gptq needs at least {gptq.default_min_tokens(k)} "
            f"calibration tokens (2 x K, K = {k}), got {tokens}: rounded to nearest instead; "
            "give more calibration data (--calib)",
            ((layer, matrices, tokens),),
        ),
        stacklevel=2,
    )


def warn_expert_fallbacks(cfg: ModelConfig, records: list[ExpertQuant], opts: QuantOptions) -> None:
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


def _threshold(opts: QuantOptions, k: int) -> int:
    """Fewest routed tokens for GPTQ on an input dim of k (as `gptq.needs_rtn_fallback`)."""
    return gptq.default_min_tokens(k) if opts.min_tokens is None else opts.min_tokens


def _fallback_entry(r: ExpertQuant) -> str:
    kinds = [k for k, m in zip(EXPERT_KINDS, r.methods, strict=True) if m == "rtn"]
    only = "" if len(kinds) == len(EXPERT_KINDS) else f", {'/'.join(kinds)} only"
    return f"E{r.expert} ({r.tokens} tokens{only})"
