"""GPTQ: beats round-to-nearest on correlated inputs, keeps the RTN format, edge cases."""

import numpy as np
import pytest

from strata_jax.formats import quant as Q
from strata_jax.tools import gptq as G

K, N, T, HELD_OUT, TRIALS = 256, 64, 2048, 1024, 20


def _correlated_inputs(rng: np.random.Generator, tokens: int, k: int = K) -> np.ndarray:
    """x = z @ A with a random mixing A whose rows have log-normal energies."""
    a = rng.normal(size=(k, k)) / np.sqrt(k) * np.exp(rng.normal(size=k))[:, None]
    return rng.normal(size=(tokens, k)) @ a


def _out_err(x: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> float:
    return float(np.linalg.norm(x @ w - x @ w_hat) / np.linalg.norm(x @ w))


@pytest.fixture(scope="module")
def trial_errors() -> dict[str, np.ndarray]:
    """Held-out output errors of each method over TRIALS random "experts"."""
    methods = {
        "rtn": lambda w, h: Q.dequantize_int4(Q.quantize_int4_rtn(w)),
        "gptq": lambda w, h: Q.dequantize_int4(G.gptq_quantize(w, h)),
        "gptq_act": lambda w, h: Q.dequantize_int4(G.gptq_quantize(w, h, act_order=True)),
        "gptq_mse": lambda w, h: Q.dequantize_int4(G.gptq_quantize(w, h, scale_method="mse")),
        "rtn8": lambda w, h: Q.dequantize_int8(G.rtn_quantize_int8(w)),
        "gptq8": lambda w, h: Q.dequantize_int8(G.gptq_quantize_int8(w, h)),
    }
    errors: dict[str, list[float]] = {m: [] for m in methods}
    for seed in range(TRIALS):
        rng = np.random.default_rng(1000 + seed)
        x = _correlated_inputs(rng, T + HELD_OUT)
        w = (rng.normal(size=(K, N)) * 0.02).astype(np.float32)
        h = G.hessian_from_inputs(x[:T])
        for m, fn in methods.items():
            errors[m].append(_out_err(x[T:], w, fn(w, h)))
    return {m: np.array(e) for m, e in errors.items()}


@pytest.mark.parametrize(("method", "baseline"), [
    ("gptq", "rtn"), ("gptq_act", "rtn"), ("gptq_mse", "rtn"), ("gptq8", "rtn8"),
])  # fmt: skip
def test_gptq_beats_rtn_on_held_out_tokens(trial_errors, method, baseline):
    ratio = trial_errors[method] / trial_errors[baseline]
    print(
        f"{method} vs {baseline}: mean output error {trial_errors[method].mean():.4f} vs "
        f"{trial_errors[baseline].mean():.4f}, mean ratio {ratio.mean():.3f}, "
        f"wins {(ratio < 1).sum()}/{TRIALS}"
    )
    assert (ratio < 1).mean() >= 0.9
    assert ratio.mean() < 0.8


def _problem(seed: int, k: int = K, n: int = N, tokens: int = 512):
    rng = np.random.default_rng(seed)
    x = _correlated_inputs(rng, tokens, k)
    return x, (rng.normal(size=(k, n)) * 0.02).astype(np.float32)


def test_gptq_output_is_rtn_format():
    x, w = _problem(1)
    for act_order in (False, True):
        qw = G.gptq_quantize(w, G.hessian_from_inputs(x), act_order=act_order)
        assert qw.packed.shape == (N, K // 2) and qw.packed.dtype == np.uint8
        assert qw.scales.shape == (K // 128, N) and qw.scales.dtype == Q.BF16
        # every value is representable with the stored scales: re-quantizing is the identity
        again = Q.quantize_int4_with_scales(Q.dequantize_int4(qw), qw.scales)
        np.testing.assert_array_equal(again.packed, qw.packed)


@pytest.mark.parametrize("method", ["absmax", "mse"])
def test_act_order_uses_static_group_scales(method):
    x, w = _problem(2)
    qw = G.gptq_quantize(w, G.hessian_from_inputs(x), act_order=True, scale_method=method)
    np.testing.assert_array_equal(qw.scales, Q.quantize_int4_rtn(w, scale_method=method).scales)


@pytest.mark.parametrize("act_order", [False, True])
def test_isotropic_hessian_reduces_to_rtn(act_order):
    _, w = _problem(3)
    qw = G.gptq_quantize(w, 3.0 * np.eye(K), act_order=act_order)
    rtn = Q.quantize_int4_rtn(w)
    np.testing.assert_array_equal(qw.packed, rtn.packed)
    np.testing.assert_array_equal(qw.scales, rtn.scales)
    np.testing.assert_array_equal(G.gptq_quantize_int8(w, np.eye(K)).q, Q.quantize_int8(w).q)


def test_dead_inputs_are_zeroed():
    x, w = _problem(4)
    x[:, [3, 200]] = 0.0
    for act_order in (False, True):
        qw = G.gptq_quantize(w, G.hessian_from_inputs(x), act_order=act_order)
        q = Q.unpack_int4(qw.packed)
        assert np.all(q[[3, 200]] == 0) and np.all(np.isfinite(Q.dequantize_int4(qw)))
        q8 = G.gptq_quantize_int8(w, G.hessian_from_inputs(x), act_order=act_order).q
        assert np.all(q8[[3, 200]] == 0)


@pytest.mark.parametrize("block", [32, 256])
def test_block_size_only_changes_rounding(block):
    x, w = _problem(5)
    h = G.hessian_from_inputs(x)
    a = G.gptq_quantize(w, h, block=128)
    b = G.gptq_quantize(w, h, block=block)
    # lazy batch updates are exact algebra: only float rounding may flip a value
    assert (Q.unpack_int4(a.packed) != Q.unpack_int4(b.packed)).mean() < 0.01
    np.testing.assert_allclose(a.scales.astype(np.float32), b.scales.astype(np.float32), rtol=0.01)


def test_bad_shapes_and_blocks_are_rejected():
    x, w = _problem(6)
    h = G.hessian_from_inputs(x)
    with pytest.raises(ValueError, match="block=96 must divide, or be a multiple of, group"):
        G.gptq_quantize(w, h, block=96)
    with pytest.raises(ValueError, match=r"^experts\.w2: .*K=192"):
        G.gptq_quantize(w[:192], h[:192, :192], name="experts.w2")
    with pytest.raises(ValueError, match=r"H \[K, K\]"):
        G.gptq_quantize(w, h[:128, :128])


def test_damping_is_raised_until_cholesky_succeeds():
    h = np.eye(128)
    h[-1, -1] = -0.05  # fails with damp 0.01 * mean(diag), succeeds with 10x
    u = G.inverse_hessian_cholesky(h, damp=0.01)
    lam = 0.1 * np.mean(np.diag(h))
    np.testing.assert_allclose(u.T @ u, np.linalg.inv(h + lam * np.eye(128)), atol=1e-10)
    assert np.allclose(u, np.triu(u))
    with pytest.raises(np.linalg.LinAlgError, match="not positive definite"):
        G.inverse_hessian_cholesky(-np.eye(128))


def test_hessian_accumulates_over_batches():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(300, 130))
    acc = G.HessianAccumulator(130)
    for chunk in np.array_split(x, [7, 100, 250]):
        acc.add(chunk)
    assert acc.count == 300
    np.testing.assert_allclose(acc.hessian, 2 / 300 * x.T @ x, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(G.hessian_from_inputs(x), acc.hessian, rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match="K=5"):
        acc.add(np.ones((2, 5)))
    with pytest.raises(ValueError, match="no calibration tokens"):
        _ = G.HessianAccumulator(4).hessian


def test_rtn_fallback_policy():
    assert G.default_min_tokens(4096) == 8192
    assert G.needs_rtn_fallback(8191, 4096) and not G.needs_rtn_fallback(8192, 4096)
    assert G.needs_rtn_fallback(99, 4096, min_tokens=100)
    assert not G.needs_rtn_fallback(100, 4096, min_tokens=100)
    assert G.needs_rtn_fallback(0, 128, min_tokens=1)


def test_quantize_expert_falls_back_to_rtn():
    x, w = _problem(9, tokens=2 * K)
    rtn = Q.quantize_int4_rtn(w)
    few = G.HessianAccumulator(K).add(x[: 2 * K - 1])
    for acc in (None, few):
        qw, method = G.quantize_expert(w, acc)
        assert method == "rtn"
        np.testing.assert_array_equal(qw.packed, rtn.packed)
    enough = G.HessianAccumulator(K).add(x)
    qw, method = G.quantize_expert(w, enough)
    assert method == "gptq"
    np.testing.assert_array_equal(qw.packed, G.gptq_quantize(w, enough.hessian).packed)
    qw, method = G.quantize_expert(w, few, G.GPTQConfig(min_tokens=16, act_order=True))
    assert method == "gptq"
    qw, method = G.quantize_expert(w, None, G.GPTQConfig(scale_method="mse"))
    assert method == "rtn"
    np.testing.assert_array_equal(qw.scales, Q.quantize_int4_rtn(w, scale_method="mse").scales)


def _reference_fasterquant(w_t, h, act_order: bool):
    """Line-by-line port of IST-DASLab/gptq `GPTQ.fasterquant` (torch, [out, in] layout), with
    `static_groups=act_order` and Strata's bf16 absmax/7 symmetric quantizer. Returns Ŵᵀ."""
    import torch

    def bf16(t):
        return t.float().to(torch.bfloat16).double()

    def quantize(x, s):
        safe = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.clamp(torch.round(x.float() / safe.float()), -8, 7).double()
        return torch.where(s == 0, torch.zeros_like(q), q) * s

    w, h, cols, group = w_t.clone(), h.clone(), w_t.shape[1], 128
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    if act_order:
        groups = [bf16(w[:, i : i + group].abs().amax(1) / 7) for i in range(0, cols, group)]
        perm = torch.argsort(torch.diag(h), descending=True, stable=True)
        w, h = w[:, perm], h[perm][:, perm]
    q_all = torch.zeros_like(w)
    h += 0.01 * torch.mean(torch.diag(h)) * torch.eye(cols, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    for i1 in range(0, cols, 128):
        i2 = min(i1 + 128, cols)
        w1, hinv1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err1 = torch.zeros(w.shape[0], i2 - i1, dtype=torch.float64)
        for i in range(i2 - i1):
            if act_order:
                scale = groups[int(perm[i1 + i]) // group]
            elif (i1 + i) % group == 0:
                scale = bf16(w[:, i1 + i : i1 + i + group].abs().amax(1) / 7)
            q = quantize(w1[:, i], scale)
            q_all[:, i1 + i] = q
            e = (w1[:, i] - q) / hinv1[i, i]
            w1[:, i:] -= e.unsqueeze(1).matmul(hinv1[i, i:].unsqueeze(0))
            err1[:, i] = e
        w[:, i2:] -= err1.matmul(hinv[i1:i2, i2:])
    return q_all[:, torch.argsort(perm)] if act_order else q_all


@pytest.mark.parametrize("act_order", [False, True])
def test_matches_reference_gptq_bit_for_bit(act_order):
    torch = pytest.importorskip("torch")
    x, w = _problem(10, tokens=1024)
    x[:, 5] = 0.0  # one dead input
    h = G.hessian_from_inputs(x)
    ref = _reference_fasterquant(torch.tensor(w.T, dtype=torch.float64), torch.tensor(h), act_order)
    ours = Q.dequantize_int4(G.gptq_quantize(w, h, act_order=act_order))
    np.testing.assert_array_equal(ours, ref.numpy().T.astype(np.float32))
