"""Sigmoid, bias-corrected, group-limited routing: the MoE gate of DeepSeek-V3, GLM-4.5 and
MiniMax-M2; and GPT-OSS's top-k-then-softmax (`route_topk_softmax`).

Each expert's score is the sigmoid of its router logit. Experts are *chosen* by score plus a
per-expert correction bias (`e_score_correction_bias`), but *weighted* by the unbiased score.
With `n_group` > 1 the experts form `n_group` equal groups, each group is rated by the sum of
its two best biased scores, and only the `topk_group` best groups stay eligible.

Ties: `jax.lax.top_k` breaks every tie (between experts, and between groups) toward the lower
index. transformers' `torch.topk` does not specify its order on ties (on CPU it often keeps a
higher index), so an exact tie at the cut is the one case where the chosen set may differ from
theirs; with float32 sigmoid scores of real logits it is rare but not impossible (saturated
scores, equal biases).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from strata_jax.formats.config import ModelConfig
from strata_jax.ops.layers import ordered_sum

NORM_EPS = 1e-20
"""Added to the top-k weights' sum before normalizing (transformers' DeepSeek-V3 and GLM-4.5)."""


@dataclass(frozen=True, kw_only=True)
class SigmoidRouting:
    """The routing switches of a sigmoid-gated MoE layer, static under jit (hashable)."""

    top_k: int
    """Experts chosen per token (HF `num_experts_per_tok`)."""
    n_group: int = 1
    """Equal groups the experts are split into; 1 means no grouping (MiniMax-M2)."""
    topk_group: int = 1
    """Groups kept per token, rated by the sum of each group's two best biased scores."""
    norm_topk_prob: bool = True
    """Scale the chosen experts' scores to sum to 1 before `routed_scaling_factor`."""
    routed_scaling_factor: float = 1.0
    """Multiplies every combine weight (after normalization, if any)."""

    def __post_init__(self) -> None:
        for name in ("top_k", "n_group", "topk_group"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"SigmoidRouting.{name} must be a positive int, got {value!r}")
        if self.topk_group > self.n_group:
            raise ValueError(f"SigmoidRouting.topk_group={self.topk_group} exceeds "
                             f"n_group={self.n_group}")
        if not math.isfinite(self.routed_scaling_factor):
            raise ValueError("SigmoidRouting.routed_scaling_factor must be finite, got "
                             f"{self.routed_scaling_factor}")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> SigmoidRouting:
        """From a Hugging Face config dict (DeepSeek-V3, GLM-4.5 / Glm4Moe, MiniMax-M2).

        Absent or None fields take the values that mean "not used": no grouping, no scaling,
        and normalization on (MiniMax-M2's config has none of these fields; its router
        always normalizes and never scales).
        """
        n_group = config.get("n_group") or 1
        topk_group = config.get("topk_group") or n_group
        norm = config.get("norm_topk_prob")
        scale = config.get("routed_scaling_factor")
        return cls(
            top_k=int(config["num_experts_per_tok"]),
            n_group=int(n_group),
            topk_group=int(topk_group),
            norm_topk_prob=True if norm is None else bool(norm),
            routed_scaling_factor=1.0 if scale is None else float(scale),
        )

    @classmethod
    def of(cls, cfg: ModelConfig) -> SigmoidRouting:
        """The routing of a model whose `scoring` is "sigmoid"."""
        return cls(top_k=cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
                   norm_topk_prob=cfg.norm_topk_prob,
                   routed_scaling_factor=cfg.routed_scaling_factor)

    def check(self, num_experts: int) -> None:
        """Raise ValueError unless this routing fits a layer of `num_experts` experts."""
        if num_experts % self.n_group:
            raise ValueError(f"{num_experts} experts do not split into n_group={self.n_group}")
        size = num_experts // self.n_group
        if self.n_group > 1 and size < 2:
            raise ValueError(f"groups of {size} expert: each group is rated by its top 2")
        if self.top_k > self.topk_group * size:
            raise ValueError(f"top_k={self.top_k} exceeds the {self.topk_group * size} experts "
                             "in the kept groups")


def route_sigmoid(
    logits: jax.Array, correction_bias: jax.Array, spec: SigmoidRouting
) -> tuple[jax.Array, jax.Array]:
    """Chosen experts int32 [N, k] and their combine weights float32 [N, k].

    logits [N, E] (router output, computed in float32), correction_bias [E]. The bias steers
    the choice only; weights are the chosen experts' sigmoid scores, normalized to sum 1 when
    `spec.norm_topk_prob`, times `spec.routed_scaling_factor`. Jit with `spec` static.
    """
    num_experts = logits.shape[-1]
    spec.check(num_experts)
    if correction_bias.shape != (num_experts,):
        raise ValueError(f"correction_bias shape {correction_bias.shape} != ({num_experts},)")
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    biased = scores + correction_bias.astype(jnp.float32)
    if spec.n_group > 1:
        biased = jnp.where(group_mask(biased, spec), biased, -jnp.inf)
    _, experts = jax.lax.top_k(biased, spec.top_k)
    experts = experts.astype(jnp.int32)
    return experts, sigmoid_weights(logits, experts, spec)


def sigmoid_weights(logits: jax.Array, experts: jax.Array, spec: SigmoidRouting) -> jax.Array:
    """float32 [N, k] combine weights of `experts` [N, k] (chosen by the router, or replayed
    from a trace): their sigmoid scores, normalized and scaled as `spec` says."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if spec.norm_topk_prob:
        weights = weights / (ordered_sum(weights, -1, keepdims=True) + NORM_EPS)
    return weights * jnp.float32(spec.routed_scaling_factor)


def group_mask(biased: jax.Array, spec: SigmoidRouting) -> jax.Array:
    """[N, E] bool: the experts in each token's `spec.topk_group` best groups.

    A group's rating is the sum of its two best biased scores (larger first, as transformers
    adds them)."""
    n, num_experts = biased.shape
    size = num_experts // spec.n_group
    best_two, _ = jax.lax.top_k(biased.reshape(n, spec.n_group, size), 2)
    rating = ordered_sum(best_two, -1)
    _, kept = jax.lax.top_k(rating, spec.topk_group)
    keep = jnp.any(kept[:, :, None] == jnp.arange(spec.n_group)[None, None, :], axis=1)
    return jnp.repeat(keep, size, axis=-1)


def route_topk_softmax(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """GPT-OSS's routing: the `top_k` largest logits [N, E] (float32) choose the experts int32
    [N, k], and the softmax over those k alone weights them, float32 [N, k]."""
    values, experts = jax.lax.top_k(logits.astype(jnp.float32), top_k)
    return experts.astype(jnp.int32), jax.nn.softmax(values, axis=-1)


def topk_softmax_weights(logits: jax.Array, experts: jax.Array) -> jax.Array:
    """float32 [N, k] weights of `experts` [N, k] (the router's, or replayed from a trace): the
    softmax over their logits, bit for bit `route_topk_softmax`'s for the router's own picks."""
    return jax.nn.softmax(jnp.take_along_axis(logits.astype(jnp.float32), experts, axis=-1),
                          axis=-1)
