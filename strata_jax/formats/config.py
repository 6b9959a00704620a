"""Model configuration: one frozen dataclass describes every supported MoE family."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
QK_NORMS = ("none", "head", "full")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and math switches of a decoder-only MoE transformer.

    `qk_norm`: "head" normalizes each head's q/k over head_dim (Qwen3-MoE), "full" normalizes
    the whole q/k projection (OLMoE). `router_bias` adds a learned-free per-expert bias to the
    router logits; only synthetic models use it, to make expert popularity long-tailed.
    `max_position`: the model's context, the longest sequence it was made for (Hugging Face's
    `max_position_embeddings`; None: not known), what `max_len` defaults to where a budget
    allows (`runtime/residency/ledger.py` `default_max_len`).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    norm_topk_prob: bool = True
    qk_norm: str = "none"
    attention_bias: bool = False
    clip_qkv: float | None = None
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_word_embeddings: bool = False
    router_bias: bool = False
    dtype: str = "float32"
    max_position: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; supported: {', '.join(FAMILIES)}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_intermediate_size > 0

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = required - set(data)
        if missing:
            raise ValueError(f"missing ModelConfig fields: {sorted(missing)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def param_counts(self) -> dict[str, int]:
        """Parameter counts split into dense (attention, norms, embeddings, shared) and routed."""
        d, layers = self.hidden_size, self.num_layers
        attn = d * self.q_size + 2 * d * self.kv_size + self.q_size * d
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        shared = 3 * d * self.shared_intermediate_size + (d if self.shared_gate else 0)
        per_layer = attn + shared + d * self.num_experts + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        routed = layers * self.num_experts * 3 * d * self.expert_intermediate_size
        dense = layers * per_layer + embed + d
        return {"dense": dense, "routed": routed, "total": dense + routed}
