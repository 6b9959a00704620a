"""Sigmoid group-limited routing against transformers' routers (DeepSeek-V3, GLM-4.5,
MiniMax-M2) and an independent float64 reference."""

import jax
import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeConfig, MiniMaxM2Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

from strata_jax.model.routing import SigmoidRouting, route_sigmoid

HIDDEN, TOKENS = 32, 96
MIN_GAP = 1e-5
"""Smallest margin at every cut the test data may have: far above float32 rounding, so both
implementations see the same order (no exact or near ties)."""

route_jit = jax.jit(route_sigmoid, static_argnames="spec")

CASES = {
    "deepseek_v3_groups_norm": (DeepseekV3Config, dict(
        n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
        norm_topk_prob=True, routed_scaling_factor=2.5)),
    "deepseek_v3_groups_raw": (DeepseekV3Config, dict(
        n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
        norm_topk_prob=False, routed_scaling_factor=2.5)),
    "glm4_moe_groups_norm": (Glm4MoeConfig, dict(
        n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
        norm_topk_prob=True, routed_scaling_factor=2.5)),
    "glm4_moe_flat_norm": (Glm4MoeConfig, dict(
        n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
        norm_topk_prob=True, routed_scaling_factor=2.5)),
    "glm4_moe_flat_raw": (Glm4MoeConfig, dict(
        n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
        norm_topk_prob=False, routed_scaling_factor=2.5)),
}
ROUTERS = {DeepseekV3Config: DeepseekV3TopkRouter, Glm4MoeConfig: Glm4MoeTopkRouter}


def _data(seed: int, num_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random hidden states [N, D], router weight [E, D] and non-zero correction bias [E]."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(TOKENS, HIDDEN)).astype(np.float32)
    w = (rng.normal(size=(num_experts, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    bias = rng.uniform(0.05, 0.3, num_experts) * rng.choice([-1.0, 1.0], num_experts)
    return h, w, bias.astype(np.float32)


def _hf_grouped(case: str, seed: int):
    """transformers' router of `case` run in float32: (config dict, logits, experts, weights,
    bias)."""
    config_cls, fields = CASES[case]
    config = config_cls(hidden_size=HIDDEN, **fields)
    router = ROUTERS[config_cls](config)
    h, w, bias = _data(seed, fields["n_routed_experts"])
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        logits, weights, experts = router(torch.from_numpy(h))
    return config.to_dict(), logits.numpy(), experts.numpy(), weights.numpy(), bias


def _by_expert(experts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token's picks sorted by expert id (the order of top-k picks is not compared)."""
    order = np.argsort(experts, axis=-1)
    return (np.take_along_axis(experts, order, -1).astype(np.int64),
            np.take_along_axis(weights, order, -1))


def _assert_same_routing(ours, theirs, rtol: float = 1e-6) -> None:
    e_ours, w_ours = _by_expert(*ours)
    e_theirs, w_theirs = _by_expert(*theirs)
    np.testing.assert_array_equal(e_ours, e_theirs)
    np.testing.assert_allclose(w_ours, w_theirs, rtol=rtol, atol=0)


def _eligible(biased: np.ndarray, spec: SigmoidRouting, gaps: list[float]) -> list[int]:
    """One token's experts in its kept groups (all of them without grouping); appends the
    margin at the group cut to `gaps`."""
    num_experts = len(biased)
    if spec.n_group == 1:
        return list(range(num_experts))
    size = num_experts // spec.n_group
    members = [range(g * size, (g + 1) * size) for g in range(spec.n_group)]
    ratings = [sum(sorted(biased[list(m)])[-2:]) for m in members]
    ranked = sorted(range(spec.n_group), key=lambda g: -ratings[g])
    if spec.topk_group < spec.n_group:
        gaps.append(ratings[ranked[spec.topk_group - 1]] - ratings[ranked[spec.topk_group]])
    return [e for g in ranked[:spec.topk_group] for e in members[g]]


def reference(logits: np.ndarray, bias: np.ndarray, spec: SigmoidRouting):
    """Float64 reference, token by token, plus the smallest margin at any cut (group cut and
    expert cut) so callers can check the data has no near ties."""
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    biased = scores + bias.astype(np.float64)
    experts = np.zeros((len(logits), spec.top_k), np.int64)
    gaps: list[float] = []
    for t, row in enumerate(biased):
        ranked = sorted(_eligible(row, spec, gaps), key=lambda e: -row[e])
        if spec.top_k < len(ranked):
            gaps.append(row[ranked[spec.top_k - 1]] - row[ranked[spec.top_k]])
        experts[t] = ranked[:spec.top_k]
    weights = np.take_along_axis(scores, experts, -1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return experts, weights * spec.routed_scaling_factor, min(gaps)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers_router(case, seed):
    config, logits, hf_experts, hf_weights, bias = _hf_grouped(case, seed)
    spec = SigmoidRouting.from_hf(config)
    experts, weights = route_jit(logits, bias, spec=spec)
    assert experts.dtype == np.int32 and weights.dtype == np.float32
    assert experts.shape == weights.shape == (TOKENS, spec.top_k)
    *_, gap = reference(logits, bias, spec)
    assert gap > MIN_GAP, "test data has a near tie; pick another seed"
    _assert_same_routing((np.asarray(experts), np.asarray(weights)), (hf_experts, hf_weights))


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_minimax_m2_router(seed):
    config = MiniMaxM2Config(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
    router = MiniMaxM2TopKRouter(config)
    h, w, bias = _data(seed, 8)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w))
        logits, hf_weights, hf_experts = router(torch.from_numpy(h), torch.from_numpy(bias))
    spec = SigmoidRouting.from_hf(config.to_dict())
    assert spec == SigmoidRouting(top_k=2)
    experts, weights = route_jit(logits.numpy(), bias, spec=spec)
    assert reference(logits.numpy(), bias, spec)[2] > MIN_GAP
    _assert_same_routing((np.asarray(experts), np.asarray(weights)),
                         (hf_experts.numpy(), hf_weights.numpy()))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_reference(case, seed):
    config, logits, *_, bias = _hf_grouped(case, seed)
    spec = SigmoidRouting.from_hf(config)
    ref_experts, ref_weights, gap = reference(logits, bias, spec)
    assert gap > MIN_GAP
    ours = route_sigmoid(logits, bias, spec)
    _assert_same_routing(tuple(np.asarray(a) for a in ours), (ref_experts, ref_weights))
    jitted = route_jit(logits, bias, spec=spec)
    for a, b in zip(ours, jitted, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bias_and_groups_change_the_choice():
    """The test data exercises both steps: dropping the bias, or the grouping, changes picks."""
    config, logits, *_, bias = _hf_grouped("deepseek_v3_groups_norm", 0)
    spec = SigmoidRouting.from_hf(config)
    picks = np.sort(np.asarray(route_sigmoid(logits, bias, spec)[0]), -1)
    unbiased = np.sort(np.asarray(route_sigmoid(logits, 0 * bias, spec)[0]), -1)
    flat = SigmoidRouting(top_k=spec.top_k, norm_topk_prob=True, routed_scaling_factor=2.5)
    ungrouped = np.sort(np.asarray(route_sigmoid(logits, bias, flat)[0]), -1)
    assert (picks != unbiased).any(axis=-1).sum() > TOKENS // 10
    assert (picks != ungrouped).any(axis=-1).sum() > TOKENS // 10


def test_weights_use_unbiased_scores():
    config, logits, *_, bias = _hf_grouped("deepseek_v3_groups_raw", 1)
    spec = SigmoidRouting.from_hf(config)
    experts, weights = (np.asarray(a) for a in route_sigmoid(logits, bias, spec))
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    np.testing.assert_allclose(weights, 2.5 * np.take_along_axis(scores, experts, -1), rtol=1e-6)


def test_ties_go_to_the_lower_index():
    logits = np.full((2, 8), 0.25, np.float32)
    bias = np.full(8, 0.1, np.float32)
    flat = np.asarray(route_sigmoid(logits, bias, SigmoidRouting(top_k=3))[0])
    np.testing.assert_array_equal(flat, [[0, 1, 2]] * 2)
    grouped = SigmoidRouting(top_k=3, n_group=4, topk_group=2)
    np.testing.assert_array_equal(np.asarray(route_sigmoid(logits, bias, grouped)[0]),
                                  [[0, 1, 2]] * 2)


def test_from_hf_configs():
    ds = SigmoidRouting.from_hf(DeepseekV3Config().to_dict())
    assert ds == SigmoidRouting(top_k=8, n_group=8, topk_group=4, norm_topk_prob=True,
                                routed_scaling_factor=2.5)
    glm = SigmoidRouting.from_hf(Glm4MoeConfig(
        n_group=2, topk_group=1, num_experts_per_tok=6, norm_topk_prob=False,
        routed_scaling_factor=1.5).to_dict())
    assert glm == SigmoidRouting(top_k=6, n_group=2, topk_group=1, norm_topk_prob=False,
                                 routed_scaling_factor=1.5)
    assert SigmoidRouting.from_hf({"num_experts_per_tok": 4, "n_group": None,
                                   "topk_group": None}) == SigmoidRouting(top_k=4)
    hash(ds)  # static under jit


@pytest.mark.parametrize("fields, experts", [
    (dict(top_k=2, n_group=3, topk_group=1), 8),   # 8 experts do not split into 3 groups
    (dict(top_k=2, n_group=8, topk_group=2), 8),   # groups of one expert
    (dict(top_k=5, n_group=4, topk_group=2), 8),   # more picks than eligible experts
])
def test_rejects_shapes_that_do_not_fit(fields, experts):
    logits = np.linspace(-1, 1, 2 * experts, dtype=np.float32).reshape(2, experts)
    with pytest.raises(ValueError):
        route_sigmoid(logits, np.linspace(0.1, 0.2, experts, dtype=np.float32),
                      SigmoidRouting(**fields))


@pytest.mark.parametrize("fields", [dict(top_k=0), dict(top_k=2, n_group=2, topk_group=3),
                                    dict(top_k=2, routed_scaling_factor=float("nan"))])
def test_rejects_bad_fields(fields):
    with pytest.raises(ValueError):
        SigmoidRouting(**fields)
