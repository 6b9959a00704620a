"""int4 g128 round-to-nearest: symmetric (Strata's format) vs asymmetric with a zero point.

Prints a markdown table (committed in docs/quantization.md) of the relative reconstruction error
||W - Ŵ|| / ||W|| and the relative output error ||xW - xŴ|| / ||xW|| on random Gaussian
activations x, for several weight distributions. Variants, all with bfloat16 scales:

* symmetric        q = clip(round(W/s), -8, 7), s = max|W_g| / 7
(strata_jax.formats.quant)
* sym. signed /-8  llama.cpp Q4_0 style: s = -W_g[argmax |W_g|] / 8, so the largest magnitude
                   lands on -8 and all 16 levels are used; s may be negative (informational)
* asymmetric       q = clip(round(W/s) + z, 0, 15), s = (max W_g - min W_g) / 15,
                   z = round(-min W_g / s) stored as a 4-bit integer per group
* "+ MSE search"   the same format with the range shrunk by r in {0.60, 0.62, ..., 1.00} (and,
                   for the signed symmetric variant, both the /7 and the /-8 scale), choosing
                   per (group, column) the candidate with the least squared error

Run: .venv/bin/python -m benchmarks.int4_symmetric_vs_zeropoint  (CPU, under a minute)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from strata_jax.formats import quant

GROUP = 128
TOKENS = 512
SEED = 0


def _grouped(w: np.ndarray) -> np.ndarray:
    k, n = w.shape
    return w.reshape(k // GROUP, GROUP, n)


def symmetric(w: np.ndarray) -> np.ndarray:
    return quant.dequantize_int4(quant.quantize_int4_rtn(w, GROUP))


def _sym_dequant(g: np.ndarray, s: np.ndarray) -> np.ndarray:
    s = quant.to_bf16(s).astype(np.float32)
    return quant.quantize_with_scales(g, s, -8, 7) * s


def _asym_dequant(g: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    s = quant.to_bf16((hi - lo) / 15).astype(np.float32)
    safe = np.where(s == 0, 1, s)
    z = np.clip(np.round(-lo / safe), 0, 15)
    return (np.clip(np.round(g / safe) + z, 0, 15) - z) * s


def _best(g: np.ndarray, candidates: Iterator[np.ndarray]) -> np.ndarray:
    """Per (group, column), the candidate reconstruction with the least squared error."""
    best, best_err = None, None
    for c in candidates:
        err = ((c - g) ** 2).sum(axis=1, keepdims=True)
        if best is None:
            best, best_err = c, err
        else:
            better = err < best_err
            best, best_err = np.where(better, c, best), np.where(better, err, best_err)
    return best


def _extremes(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group: signed value of largest magnitude, min (<= 0) and max (>= 0)."""
    peak = np.take_along_axis(g, np.abs(g).argmax(axis=1)[:, None, :], axis=1)
    lo = np.minimum(g.min(axis=1, keepdims=True), 0)
    hi = np.maximum(g.max(axis=1, keepdims=True), 0)
    return peak, lo, hi


def symmetric_signed(w: np.ndarray) -> np.ndarray:
    g = _grouped(w)
    peak, _, _ = _extremes(g)
    return _sym_dequant(g, -peak / 8).reshape(w.shape)


def symmetric_signed_search(w: np.ndarray) -> np.ndarray:
    g = _grouped(w)
    peak, _, _ = _extremes(g)
    cands = (_sym_dequant(g, r * s) for r in SHRINK for s in (-peak / 8, np.abs(peak) / 7))
    return _best(g, cands).reshape(w.shape)


def asymmetric(w: np.ndarray) -> np.ndarray:
    g = _grouped(w)
    _, lo, hi = _extremes(g)
    return _asym_dequant(g, lo, hi).reshape(w.shape)


def asymmetric_search(w: np.ndarray) -> np.ndarray:
    g = _grouped(w)
    _, lo, hi = _extremes(g)
    return _best(g, (_asym_dequant(g, r * lo, r * hi) for r in SHRINK)).reshape(w.shape)


SHRINK = np.linspace(0.6, 1.0, 21)
VARIANTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "symmetric": symmetric,
    "sym. signed /-8": symmetric_signed,
    "sym. signed + MSE search": symmetric_signed_search,
    "asymmetric + zero": asymmetric,
    "asym. + MSE search": asymmetric_search,
}
SYM_BITS, ASYM_BITS = 4 + 16 / GROUP, 4 + 20 / GROUP  # bf16 scale (+ 4-bit zero) per group


def hf_expert_weights(family: str) -> Iterator[np.ndarray]:
    """[in, out] expert matrices of a tiny random transformers model (init std 0.02)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(SEED)
    common = dict(vocab_size=64, hidden_size=512, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.02)  # fmt: skip
    if family == "mixtral":
        cfg = MixtralConfig(intermediate_size=1024, num_local_experts=4, **common)
        model = MixtralForCausalLM(cfg)
    else:
        cfg = Qwen3MoeConfig(intermediate_size=1024, moe_intermediate_size=1024, num_experts=4,
                             num_experts_per_tok=2, **common)  # fmt: skip
        model = Qwen3MoeForCausalLM(cfg)
    experts = model.model.layers[0].mlp.experts
    gate_up = experts.gate_up_proj.detach().float().numpy()  # [E, 2F, D]
    down = experts.down_proj.detach().float().numpy()  # [E, D, F]
    f = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        yield gate_up[e, :f].T  # w1 [D, F]
        yield gate_up[e, f:].T  # w3 [D, F]
        yield down[e].T  # w2 [F, D]


def synthetic(kind: str, count: int = 4, k: int = 1024, n: int = 1024) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(SEED)
    for _ in range(count):
        if kind == "gaussian":
            yield rng.normal(0, 0.02, (k, n))
        elif kind == "student_t":
            yield rng.standard_t(4, (k, n)) * 0.02
        else:  # zero-mean noise on a per-column offset: groups that are not centred on zero
            yield rng.normal(0, 0.02, (k, n)) + rng.normal(0, 0.01, (1, n))


def measure(weights: Iterator[np.ndarray]) -> dict[str, tuple[float, float]]:
    """Mean (reconstruction error, output error) of each variant over the matrices."""
    rng = np.random.default_rng(SEED + 1)
    totals = {name: np.zeros(2) for name in VARIANTS}
    count = 0
    for w in weights:
        w = np.asarray(w, np.float32)
        x = rng.normal(size=(TOKENS, w.shape[0])).astype(np.float32)
        y = x.astype(np.float64) @ w
        for name, fn in VARIANTS.items():
            w_hat = fn(w)
            rec = np.linalg.norm(w - w_hat) / np.linalg.norm(w)
            out = np.linalg.norm(y - x.astype(np.float64) @ w_hat) / np.linalg.norm(y)
            totals[name] += (rec, out)
        count += 1
    return {name: (t[0] / count, t[1] / count) for name, t in totals.items()}


CASES: dict[str, Callable[[], Iterator[np.ndarray]]] = {
    "(a) Gaussian N(0, 0.02²), 4 × [1024, 1024]": lambda: synthetic("gaussian"),
    "(b) tiny random Mixtral experts, std 0.02 (12 matrices)": lambda: hf_expert_weights("mixtral"),
    "(b) tiny random Qwen3-MoE experts, std 0.02 (12)": lambda: hf_expert_weights("qwen3_moe"),
    "(c) Student-t df=4, 4 × [1024, 1024]": lambda: synthetic("student_t"),
    "(stress) Gaussian + per-column offset N(0, 0.01²)": lambda: synthetic("offset"),
}


def main() -> None:
    names = list(VARIANTS)
    print(f"relative error, reconstruction / output (lower is better); bits per weight: "
          f"symmetric {SYM_BITS:.3f}, asymmetric {ASYM_BITS:.3f}")  # fmt: skip
    print()
    print("| weights | " + " | ".join(names) + " | asym / sym (output) |")
    print("|---|" + "---|" * (len(names) + 1))
    for label, make in CASES.items():
        res = measure(make())
        cells = [f"{res[n][0]:.4f} / {res[n][1]:.4f}" for n in names]
        ratio = res["asymmetric + zero"][1] / res["symmetric"][1]
        print(f"| {label} | " + " | ".join(cells) + f" | {ratio:.3f} |")


if __name__ == "__main__":
    main()
