"""Model configuration: one frozen dataclass describes every supported MoE family."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "minimax_m2", "deepseek_v3",
            "gpt_oss", "qwen3_next")
QK_NORMS = ("none", "head", "full")
SCORINGS = ("softmax", "sigmoid", "topk_softmax")
ATTENTIONS = ("gqa", "mla")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and math switches of a decoder-only MoE transformer.

    `qk_norm`: "head" normalizes each head's q/k over head_dim (Qwen3-MoE), "full" normalizes
    the whole q/k projection (OLMoE). `router_bias` adds a per-expert bias to the router
    logits: GPT-OSS's learned one, or a synthetic model's, which makes expert popularity
    long-tailed.
    `max_position`: the model's context, the longest sequence it was made for (Hugging Face's
    `max_position_embeddings`; None: not known), what `max_len` defaults to where a budget
    allows (`runtime/residency/ledger.py` `default_max_len`).

    Layers: `num_layers` counts the MoE layers, those with routed experts (what the tiers, the
    expert files and every [layer, expert] table index); `dense_layers` layers with a plain
    SwiGLU MLP of width `dense_intermediate_size` come before them (DeepSeek's and GLM's
    `first_k_dense_replace`), so the decoder has `total_layers` layers.

    Routing: "softmax" scores (Mixtral, Qwen, OLMoE), "sigmoid" scores chosen with a
    per-expert correction bias within the `topk_group` best of `n_group` groups and weighted
    by `routed_scaling_factor` (DeepSeek-V3, GLM-4.5, MiniMax-M2: `model/routing.py`), or
    "topk_softmax": the top-k logits, weighted by their own softmax (GPT-OSS).

    GPT-OSS's switches: `o_bias` (wo has a bias, `bo`; `attention_bias` covers q/k/v),
    `attention_sinks` (a learned logit per head, `sinks`, joins each softmax's denominator and
    mixes no value), `sliding_window` with `sliding_layers` (the decoder layers, counted over
    `total_layers`, whose queries see only the last `sliding_window` positions, themselves
    included; the cache keeps every position: a mask, `decoder.cached_attention`),
    `expert_bias` (each expert carries biases `b1`, `b3` [F] and `b2` [D] beside its weights)
    and `swiglu_limit` (None: silu(gate) * up; a limit: the clamped form `(up + 1) * gate *
    sigmoid(swiglu_alpha * gate)` with gate clamped above at the limit and up to +-limit,
    `expert_kernels.Glu`).

    Attention: "gqa", or "mla" (DeepSeek's multi-head latent attention: q through the
    optional `q_lora_rank` bottleneck, the cache holding the `kv_lora_rank` latent and the
    shared `qk_rope_head_dim` rope key; `head_dim` is then qk_nope_head_dim +
    qk_rope_head_dim). `rotary_dim`: the leading dims of each head that rotate (None: all);
    `rope_interleave`: rotate interleaved pairs (DeepSeek) instead of the two halves.
    `rope_scaling`: YaRN's fields as Hugging Face names them (None: plain RoPE).

    Qwen3-Next's switches: `attention_gate` (the attention output times the sigmoid of a
    per-head gate projection of the layer input, `wgate`, before wo) and `linear_layers` (the
    decoder layers that mix tokens by a Gated DeltaNet instead of attention: a short causal
    convolution, the gated delta rule over a recurrent state [value heads, key dim, value
    dim] per row, a gated RMSNorm; `model/linear_attention.py`). A model with linear layers
    keeps its two kinds of token-mixer params apart (`attn_layer_shapes`,
    `linear_layer_shapes`), stacked over the layers of each kind, and its KV cache covers only
    the attention layers (`attention_layers`).

    `mtp_layers`: multi-token-prediction modules kept in the checkpoint (DeepSeek-V3's and
    GLM-4.5's `num_nextn_predict_layers`): each an MoE decoder layer fed by the projection
    of the next token's embedding and the model's last hidden state (`model/mtp.py`), its
    experts stored past the MoE layers'; the engine does not load them.
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
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    dense_layers: int = 0
    dense_intermediate_size: int = 0
    attention: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rotary_dim: int | None = None
    rope_interleave: bool = False
    rope_scaling: tuple[tuple[str, float], ...] | None = None
    mtp_layers: int = 0
    o_bias: bool = False
    attention_sinks: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention_gate: bool = False
    """The attention output is gated per head by sigmoid(h @ wgate) before wo (Qwen3-Next)."""
    linear_layers: tuple[int, ...] = ()
    """Decoder layers (over `total_layers`) whose token mixer is a Gated DeltaNet."""
    linear_conv_kernel: int = 4
    """Taps of the linear layers' causal depthwise convolution (the conv state keeps one
    fewer inputs)."""
    linear_key_heads: int = 0
    """Query/key heads of a linear layer (each serves linear_value_heads / linear_key_heads
    value heads)."""
    linear_value_heads: int = 0
    """Value heads of a linear layer: one recurrent state [key dim, value dim] each."""
    linear_key_dim: int = 0
    """Dims of a linear layer's query and key heads."""
    linear_value_dim: int = 0
    """Dims of a linear layer's value heads."""

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
        for name, value, allowed in (("scoring", self.scoring, SCORINGS),
                                     ("attention", self.attention, ATTENTIONS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if self.dense_layers and self.dense_intermediate_size <= 0:
            raise ValueError("dense_layers needs dense_intermediate_size > 0")
        if self.attention == "mla" and not (self.kv_lora_rank and self.qk_rope_head_dim
                                            and self.v_head_dim):
            raise ValueError("attention='mla' needs kv_lora_rank, qk_rope_head_dim, v_head_dim")
        if self.rotary_dim is not None and not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be in (0, {self.head_dim}]")
        if self.rope_scaling is not None:  # from JSON or a dict: a hashable, ordered form
            items = (self.rope_scaling.items() if isinstance(self.rope_scaling, dict)
                     else self.rope_scaling)
            object.__setattr__(self, "rope_scaling", tuple(sorted((str(k), v) for k, v in items)))
        self._check_windows()
        self._check_linear()

    def _check_linear(self) -> None:
        """`linear_layers` as a sorted tuple of MoE layers, with the head shapes they need."""
        layers = tuple(sorted({int(i) for i in self.linear_layers}))
        object.__setattr__(self, "linear_layers", layers)
        if not layers:
            return
        if not self.dense_layers <= layers[0] <= layers[-1] < self.total_layers:
            raise ValueError(f"linear_layers={layers} must lie in the MoE layers [dense_layers="
                             f"{self.dense_layers}, total_layers={self.total_layers})")
        if self.attention != "gqa" or self.sliding_layers or self.dense_layers:
            raise ValueError("linear_layers are implemented beside GQA attention layers only "
                             "(no MLA, sliding windows or dense-MLP layers)")
        heads = (self.linear_key_heads, self.linear_value_heads, self.linear_key_dim,
                 self.linear_value_dim, self.linear_conv_kernel)
        if min(heads) <= 0 or self.linear_value_heads % self.linear_key_heads:
            raise ValueError(
                f"linear_layers need positive linear_key_heads, linear_value_heads (a multiple "
                f"of the key heads), linear_key_dim, linear_value_dim, linear_conv_kernel; got "
                f"{heads}")

    def _check_windows(self) -> None:
        """`sliding_layers` as a sorted tuple (JSON gives a list) of layers that exist, and a
        window wherever a layer slides."""
        layers = tuple(sorted({int(i) for i in self.sliding_layers}))
        object.__setattr__(self, "sliding_layers", layers)
        if layers and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"sliding_layers={layers} need sliding_window > 0, got "
                             f"{self.sliding_window!r}")
        if layers and not 0 <= layers[0] <= layers[-1] < self.total_layers:
            raise ValueError(f"sliding_layers={layers} must lie in [0, total_layers="
                             f"{self.total_layers})")
        if self.attention == "mla" and layers:
            raise ValueError("sliding-window attention is implemented for attention='gqa'")

    @property
    def total_layers(self) -> int:
        """Decoder layers: the dense-MLP ones first, then the MoE ones."""
        return self.dense_layers + self.num_layers

    def layer_windows(self) -> tuple[int, ...] | None:
        """Each decoder layer's attention window (0: the whole prefix), or None where no layer
        slides."""
        if not self.sliding_layers:
            return None
        return tuple(self.sliding_window if i in self.sliding_layers else 0
                     for i in range(self.total_layers))

    @property
    def attention_layers(self) -> int:
        """Decoder layers that attend over a KV cache (all but the linear ones)."""
        return self.total_layers - len(self.linear_layers)

    def mixer_slots(self) -> tuple[tuple[bool, ...], tuple[int, ...]]:
        """Per MoE layer: whether it is a linear layer, and its index among the layers of its
        kind (its row of that kind's stacked params and of its state: KV cache or linear
        states)."""
        linear = tuple(self.dense_layers + i in self.linear_layers
                       for i in range(self.num_layers))
        counts = {True: 0, False: self.dense_layers}
        slots = []
        for lin in linear:
            slots.append(counts[lin])
            counts[lin] += 1
        return linear, tuple(slots)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear layer's convolution: its queries, keys and values."""
        return (2 * self.linear_key_heads * self.linear_key_dim
                + self.linear_value_heads * self.linear_value_dim)

    def linear_state_specs(self, batch: int
                           ) -> tuple[tuple[tuple[int, ...], str], tuple[tuple[int, ...], str]]:
        """The linear layers' decode state as (shape, dtype name) pairs: the conv state
        [L_lin, B, kernel - 1, conv dim] in the model dtype (the last inputs of the
        convolution) and the recurrent state [L_lin, B, value heads, key dim, value dim] in
        float32 (the recurrence accumulates across every token)."""
        n = len(self.linear_layers)
        return (((n, batch, self.linear_conv_kernel - 1, self.linear_conv_dim), self.dtype),
                ((n, batch, self.linear_value_heads, self.linear_key_dim,
                  self.linear_value_dim), "float32"))

    @property
    def rope_dim(self) -> int:
        """The dims of each head (MLA: of the shared rope key) that rotate."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def qk_nope_head_dim(self) -> int:
        """MLA: the per-head dims of q and k that do not rotate."""
        return self.head_dim - self.qk_rope_head_dim

    def cache_shapes(self, batch: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the two stacked cache arrays over every layer: GQA's keys and values
        [L, B, S, kv_heads, head_dim]; MLA's latent [L, B, S, 1, kv_lora_rank] and rope key
        [L, B, S, 1, qk_rope_head_dim] (what decode attends over, docs/design.md, "MLA");
        L counts the layers that attend (`attention_layers`)."""
        lead = (self.attention_layers, batch, max_len)
        if self.attention == "mla":
            return (*lead, 1, self.kv_lora_rank), (*lead, 1, self.qk_rope_head_dim)
        return (*lead, self.num_kv_heads, self.head_dim), (*lead, self.num_kv_heads,
                                                           self.head_dim)

    @property
    def cache_width(self) -> int:
        """Cached values per token and layer (keys and values, or latent and rope key)."""
        k, v = self.cache_shapes(1, 1)
        return k[-1] * k[-2] + v[-1] * v[-2]

    @property
    def o_size(self) -> int:
        """Width of the attention output before wo (MLA: heads x v_head_dim)."""
        return self.num_heads * (self.v_head_dim if self.attention == "mla" else self.head_dim)

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
        d = self.hidden_size
        per_layer = sum(math.prod(s) for s in dense_layer_shapes(self).values())
        mlp_layer = sum(math.prod(s) for s in mlp_layer_shapes(self).values())
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        per_expert = 3 * d * self.expert_intermediate_size
        if self.expert_bias:
            per_expert += 2 * self.expert_intermediate_size + d
        routed = self.num_layers * self.num_experts * per_expert
        dense = self.num_layers * per_layer + self.dense_layers * mlp_layer + embed + d
        if self.linear_layers:
            lin = sum(math.prod(s) for s in linear_layer_shapes(self).values())
            attn = sum(math.prod(s) for s in attn_layer_shapes(self).values())
            dense += len(self.linear_layers) * lin + (self.num_layers - len(
                self.linear_layers)) * attn
        return {"dense": dense, "routed": routed, "total": dense + routed}


F32_PARAMS = ("router", "router_correction")
"""Params of sigmoid-routed layers kept in float32 whatever the model's dtype: the choice
among experts compares biased scores, which bfloat16 would round (transformers keeps them so)."""


def attention_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                                 dict[str, tuple[int, ...]]]:
    """Shapes of one layer's attention params: (its input norm and matrices, its biases and
    q/k norms). Two parts so that a layer's params keep the order the checkpoints and the
    seeded test models have always drawn them in."""
    d = cfg.hidden_size
    if cfg.attention == "mla":
        h, r = cfg.num_heads, cfg.kv_lora_rank
        q = ({"wq_a": (d, cfg.q_lora_rank), "wq_b": (cfg.q_lora_rank, cfg.q_size)}
             if cfg.q_lora_rank else {"wq": (d, cfg.q_size)})
        core = {"attn_norm": (d,), **q, "wkv_a": (d, r + cfg.qk_rope_head_dim),
                "wkv_b": (r, h * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
                "wo": (cfg.o_size, d)}
        extra = {"kv_a_norm": (r,)}
        if cfg.q_lora_rank:
            extra["q_a_norm"] = (cfg.q_lora_rank,)
        return core, extra
    q, kv = cfg.q_size, cfg.kv_size
    core = {"attn_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d)}
    extra: dict[str, tuple[int, ...]] = {}
    if cfg.attention_bias:
        extra.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.o_bias:
        extra["bo"] = (d,)
    if cfg.attention_sinks:
        extra["sinks"] = (cfg.num_heads,)
    if cfg.attention_gate:
        extra["wgate"] = (d, q)
    if cfg.qk_norm == "head":
        extra.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    elif cfg.qk_norm == "full":
        extra.update(q_norm=(q,), k_norm=(kv,))
    return core, extra


def dense_layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one MoE layer's dense params (the stacked arrays add a leading layer axis)."""
    d = cfg.hidden_size
    core, extra = attention_shapes(cfg)
    if cfg.linear_layers:  # the token mixers' params are stacked by kind apart
        core, extra = {"attn_norm": core["attn_norm"]}, {}
    shapes = {"attn_norm": core.pop("attn_norm"), "mlp_norm": (d,), **core,
              "router": (d, cfg.num_experts), **extra}
    if cfg.router_bias:
        shapes["router_bias"] = (cfg.num_experts,)
    if cfg.scoring == "sigmoid":
        shapes["router_correction"] = (cfg.num_experts,)
    if cfg.has_shared_expert:
        fs = cfg.shared_intermediate_size
        shapes.update(shared_w1=(d, fs), shared_w3=(d, fs), shared_w2=(fs, d))
        if cfg.shared_gate:
            shapes["shared_gate"] = (d,)
    return shapes


def attn_layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one attention layer's token-mixer params in a model with linear layers
    (`ModelConfig.linear_layers`; its input norm stays with the MoE layer's params)."""
    core, extra = attention_shapes(cfg)
    core.pop("attn_norm")
    return {**core, **extra}


def linear_layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one Gated DeltaNet layer's token-mixer params (`model/linear_attention.py`):
    the input projection to queries, keys, values and the output gate z (`w_qkvz`, each part
    head-major), to the update rate b and the decay input a (`w_ba`), the convolution
    [kernel, conv dim], the decay's `a_log` and `dt_bias` per value head, the gated norm over
    a value head, and `w_out`."""
    d, hv = cfg.hidden_size, cfg.linear_value_heads
    value = hv * cfg.linear_value_dim
    return {"w_qkvz": (d, cfg.linear_conv_dim + value), "w_ba": (d, 2 * hv),
            "conv": (cfg.linear_conv_kernel, cfg.linear_conv_dim), "a_log": (hv,),
            "dt_bias": (hv,), "out_norm": (cfg.linear_value_dim,), "w_out": (value, d)}


def mtp_layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one multi-token-prediction module's dense params: an MoE layer's, the norms
    of its two inputs, their projection and its head's norm (`model/mtp.py`)."""
    d = cfg.hidden_size
    return {**dense_layer_shapes(cfg), "enorm": (d,), "hnorm": (d,), "eh_proj": (2 * d, d),
            "head_norm": (d,)}


def mlp_layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one dense-MLP layer's params (the `dense_layers` before the MoE layers)."""
    d, f = cfg.hidden_size, cfg.dense_intermediate_size
    core, extra = attention_shapes(cfg)
    return {**core, **extra, "mlp_norm": (d,), "ffn_w1": (d, f), "ffn_w3": (d, f),
            "ffn_w2": (f, d)}
