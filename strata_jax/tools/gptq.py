"""GPTQ (Frantar et al., 2022) for `[in, out]` weights, producing the formats of `quant`.

GPTQ quantizes one *input* row of W [K, N] at a time and spreads that row's rounding error over
the rows not yet quantized, weighted by the inverse Hessian H = 2/T · XᵀX of the layer's
calibration inputs X [T, K]. The output has exactly the layout of round-to-nearest
(`quant.quantize_int4_rtn` / `quant.quantize_int8`), so every reader is agnostic to how a weight
was quantized. Computation is float64 numpy. See docs/quantization.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.linalg

from strata_jax.formats import quant
from strata_jax.formats.quant import GROUP, INT4_MAX, INT4_MIN, INT8_MAX, Int4Weight, Int8Weight

DAMP_RETRIES = 4  # each retry multiplies the damping by 10


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ knobs. `min_tokens` None means `default_min_tokens(K)`; see `needs_rtn_fallback`."""

    group: int = GROUP
    damp: float = 0.01
    act_order: bool = False
    block: int = 128
    min_tokens: int | None = None
    scale_method: str = "absmax"


# --------------------------------------------------------------------------- Hessians


class HessianAccumulator:
    """Accumulates H = 2/T · XᵀX over batches of layer inputs X [t, K] (float64)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.count = 0
        self._xtx = np.zeros((k, k), np.float64)

    def add(self, x: np.ndarray) -> HessianAccumulator:
        """Add a batch of inputs [t, K] (leading axes are flattened into tokens)."""
        x = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
        if x.shape[1] != self.k:
            raise ValueError(f"inputs have K={x.shape[1]}, accumulator expects K={self.k}")
        self._xtx += x.T @ x
        self.count += x.shape[0]
        return self

    @property
    def hessian(self) -> np.ndarray:
        if self.count == 0:
            raise ValueError("no calibration tokens were added to this HessianAccumulator")
        return self._xtx * (2.0 / self.count)


def hessian_from_inputs(x: np.ndarray) -> np.ndarray:
    """H = 2/T · XᵀX for inputs x [T, K]."""
    return HessianAccumulator(np.shape(x)[-1]).add(x).hessian


# --------------------------------------------------------------------------- fallback policy


def default_min_tokens(k: int) -> int:
    """Fewest calibration tokens for which GPTQ is used on an input dim of `k`: 2·K.

    Below K tokens the sample Hessian is singular and GPTQ moves rounding error into directions
    the calibration never saw; docs/quantization.md has the measurements behind the factor 2.
    """
    return 2 * k


def needs_rtn_fallback(count: int, k: int, min_tokens: int | None = None) -> bool:
    """True when `count` calibration tokens are too few for GPTQ on an input dim of `k`."""
    threshold = default_min_tokens(k) if min_tokens is None else min_tokens
    return count < threshold


# --------------------------------------------------------------------------- core


def _prepare(
    w: np.ndarray, h: np.ndarray, act_order: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dead inputs zeroed, optional act-order permutation: (W, H, perm) in float64."""
    w = np.array(w, np.float64)
    h = np.array(h, np.float64)
    k = w.shape[0] if w.ndim == 2 else -1
    if k < 0 or h.shape != (k, k):
        raise ValueError(f"need w [K, N] and H [K, K], got {w.shape} and {h.shape}")
    if not (np.all(np.isfinite(w)) and np.all(np.isfinite(h))):
        raise ValueError("GPTQ inputs contain non-finite values")
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[dead, :] = 0.0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    return w[perm], h[np.ix_(perm, perm)], perm


def inverse_hessian_cholesky(h: np.ndarray, damp: float = 0.01) -> np.ndarray:
    """Upper Cholesky factor U of (H + λI)⁻¹ (so (H + λI)⁻¹ = UᵀU), λ = damp · mean(diag H).

    When a factorization fails the damping is multiplied by 10, up to DAMP_RETRIES times.
    """
    # With P the index reversal and PHP = LLᵀ, H⁻¹ = (P L⁻¹ P)ᵀ (P L⁻¹ P) and P L⁻¹ P is upper
    # triangular: one Cholesky and one triangular inverse (K³ · 2/3 flops) give U.
    mean_diag = float(np.mean(np.diag(h)))
    reversed_h = np.array(h[::-1, ::-1], np.float64)
    diag = np.arange(h.shape[0])
    for attempt in range(DAMP_RETRIES + 1):
        damped = reversed_h.copy()
        damped[diag, diag] += damp * 10.0**attempt * mean_diag
        try:
            lower = scipy.linalg.cholesky(damped, lower=True, check_finite=False)
        except np.linalg.LinAlgError:
            continue
        inv_lower, info = scipy.linalg.lapack.dtrtri(lower, lower=1)
        if info == 0 and np.all(np.isfinite(inv_lower)):
            return np.ascontiguousarray(np.triu(inv_lower[::-1, ::-1]))
    raise np.linalg.LinAlgError(
        f"Hessian is not positive definite even with damping {damp * 10.0**DAMP_RETRIES:g}"
    )


def _gptq_rows(
    w: np.ndarray,
    u: np.ndarray,
    scales: tuple[np.ndarray, np.ndarray] | None,
    qmin: int,
    qmax: int,
    group: int,
    block: int,
    scale_method: str = "absmax",
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize the rows of w [K, N] in order with GPTQ error feedback.

    `scales` = (table [S, N], row_index [K]) fixes row i's scale to table[row_index[i]]. None
    means int4 groups whose bfloat16 scale (by `scale_method`) is taken from the error-updated
    rows when entering each group. Rows of a block get rank-1 updates row by row and later rows
    one matrix product per block ("lazy batch"), so when block and group divide one another, a
    group's rows have received every earlier row's update by the time the group starts.
    Returns (q int8 [K, N], scales used [K/group, N]).
    """
    k, n = w.shape
    w = w.copy()
    q = np.zeros((k, n), np.int8)
    group_scales: list[np.ndarray] = []
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, ub = w[b0:b1], u[b0:b1, b0:b1]
        err = np.zeros((b1 - b0, n))
        for i in range(b1 - b0):
            if scales is None:
                if (b0 + i) % group == 0:
                    rows = w[b0 + i : b0 + i + group]
                    group_scales.append(quant.int4_scales(rows, group, scale_method)[0])
                s = group_scales[-1].astype(np.float64)
            else:
                s = scales[0][scales[1][b0 + i]]
            qi = quant.quantize_with_scales(wb[i], s, qmin, qmax)
            q[b0 + i] = qi
            e = (wb[i] - qi * s) / ub[i, i]
            wb[i:] -= np.outer(ub[i, i:], e)
            err[i] = e
        w[b1:] -= u[b0:b1, b1:].T @ err
    used = np.stack(group_scales) if scales is None else np.empty((0, n))
    return q, used


# --------------------------------------------------------------------------- public API


def gptq_quantize(
    w: np.ndarray,
    h: np.ndarray,
    group: int = GROUP,
    damp: float = 0.01,
    act_order: bool = False,
    block: int = 128,
    name: str | None = None,
    scale_method: str = "absmax",
) -> Int4Weight:
    """GPTQ int4 with the packed layout and grouping of `quant.quantize_int4_rtn`.

    Without act_order, each group's scale comes from the error-updated rows when GPTQ reaches
    the group. With act_order, rows are processed by descending diag(H) and the scales are
    fixed up front per original group from the (dead-row-zeroed) weights ("static groups").
    `scale_method` is "absmax" (max|W_g| / 7) or "mse" (see `quant.int4_mse_scales`).
    """
    quant.check_group(np.shape(w)[0], group, name)
    if block <= 0 or (block % group and group % block):
        raise ValueError(f"GPTQ block={block} must divide, or be a multiple of, group={group}")
    wp, hp, perm = _prepare(w, h, act_order)
    u = inverse_hessian_cholesky(hp, damp)
    if act_order:
        scales = quant.int4_scales(wp[np.argsort(perm)], group, scale_method, name)
        fixed = (scales.astype(np.float64), perm // group)
        qp, _ = _gptq_rows(wp, u, fixed, INT4_MIN, INT4_MAX, group, block)
    else:
        qp, used = _gptq_rows(wp, u, None, INT4_MIN, INT4_MAX, group, block, scale_method)
        scales = used.astype(quant.BF16)
    q = qp[np.argsort(perm)]
    return Int4Weight(quant.pack_int4(q, group, name), scales)


def gptq_quantize_int8(
    w: np.ndarray,
    h: np.ndarray,
    damp: float = 0.01,
    act_order: bool = False,
    block: int = 128,
) -> Int8Weight:
    """GPTQ int8 per-output-channel; the absmax column scales are fixed up front."""
    wp, hp, perm = _prepare(w, h, act_order)
    u = inverse_hessian_cholesky(hp, damp)
    scales = quant.int8_absmax_scales(wp)
    fixed = (scales.astype(np.float64)[None], np.zeros(wp.shape[0], np.intp))
    qp, _ = _gptq_rows(wp, u, fixed, -INT8_MAX, INT8_MAX, block, block)
    return Int8Weight(qp[np.argsort(perm)], scales)


def rtn_quantize_int8(w: np.ndarray) -> Int8Weight:
    """Round-to-nearest int8 (alias of `quant.quantize_int8`)."""
    return quant.quantize_int8(w)


def quantize_expert(
    w: np.ndarray,
    acc: HessianAccumulator | None,
    cfg: GPTQConfig | None = None,
    name: str | None = None,
) -> tuple[Int4Weight, str]:
    """int4 for one expert weight: GPTQ, or RTN if it saw too few tokens. Returns (weight, method).

    `method` is "gptq" or "rtn" (for the conversion report).
    """
    cfg = cfg or GPTQConfig()
    k = np.shape(w)[0]
    if acc is None or needs_rtn_fallback(acc.count, k, cfg.min_tokens):
        return quant.quantize_int4_rtn(w, cfg.group, name, cfg.scale_method), "rtn"
    weight = gptq_quantize(
        w, acc.hessian, cfg.group, cfg.damp, cfg.act_order, cfg.block, name, cfg.scale_method
    )
    return weight, "gptq"
