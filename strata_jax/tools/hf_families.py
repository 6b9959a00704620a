"""How each Hugging Face `model_type` maps onto the Strata model: config fields and tensor names.

Supported: mixtral, qwen2_moe, qwen3_moe, olmoe (softmax routing, GQA), glm4_moe (GQA with
partial rotary, sigmoid routing with groups, shared experts, dense first layers), minimax_m2
(GQA with full q/k norm and partial rotary, sigmoid routing), deepseek_v3 (multi-head latent
attention, YaRN, grouped sigmoid routing, shared experts, dense first layers) and gpt_oss
(attention sinks, sliding-window layers, q/k/v/o biases, YaRN, a biased top-k-then-softmax
router, biased experts with the clamped SwiGLU, their gate and up interleaved in one
transposed `gate_up_proj`) and qwen3_next (Gated DeltaNet layers among gated attention layers
with q/k norm and partial rotary, norms that scale by 1 + weight, a shared expert with its
sigmoid gate). Hugging Face's config is the source of truth: every field whose
math the model lacks is refused by name.

Layers: HF layer i < `first_k_dense_replace` is dense-MLP layer i, a later one MoE layer
i - first_k_dense_replace (`ModelConfig.dense_layers`). The layers past `num_hidden_layers`
that hold an `eh_proj` are the multi-token-prediction modules of DeepSeek-V3 and GLM-4.5
(`ModelConfig.mtp_layers`, `model/mtp.py`); their copies of the embedding and the output head
are the model's own and are not kept twice (`shared_copies`).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from strata_jax.formats.checkpoint import (
    EXPERT_KINDS,
    dense_layer_shapes,
    expert_shape,
    global_shapes,
    mixer_arrays,
    mixer_counts,
    mlp_layer_shapes,
    mtp_layer_shapes,
)
from strata_jax.formats.config import DTYPES, ModelConfig
from strata_jax.model.routing import SigmoidRouting


@dataclass(frozen=True, kw_only=True)
class Family:
    """How one HF `model_type` names its config fields and MoE tensors."""

    name: str
    """The `model_type`, and `ModelConfig.family`."""
    experts_keys: tuple[str, ...]
    """Config keys for the expert count, first present wins."""
    intermediate_key: str
    """Config key for the routed expert FFN width."""
    moe_prefixes: tuple[str, ...]
    """Module holding router + experts; the first is canonical."""
    split_names: tuple[str, str, str]
    """Per-expert tensor names for (w1, w3, w2)."""
    qk_norm: str
    """`ModelConfig.qk_norm` (a family with `use_qk_norm` takes it only where set)."""
    rope_theta: float
    """Default when the config names none."""
    rms_eps: float
    """Default when the config names none."""
    sigmoid: bool = False
    """Sigmoid routing with a correction bias (`model/routing.py`)."""
    correction: str = "gate.e_score_correction_bias"
    """The correction bias' tensor under the MoE module."""
    shared_module: str = "shared_expert"
    """The shared expert's module under the MoE module."""
    router: str = "gate"
    """The router's module under the MoE module."""
    default_rope: tuple[tuple[str, Any], ...] = ()
    """The rope parameters transformers assumes where config.json names none."""
    norm_offset: float = 0.0
    """1.0 where HF's RMSNorms scale by 1 + weight (Qwen3-Next): stored as 1 + weight."""


_PROJ_NAMES = ("gate_proj", "up_proj", "down_proj")
_W_NAMES = ("w1", "w3", "w2")
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family(name="mixtral", experts_keys=("num_local_experts", "num_experts"),
           intermediate_key="intermediate_size", moe_prefixes=("block_sparse_moe", "mlp"),
           split_names=_W_NAMES, qk_norm="none", rope_theta=1e6, rms_eps=1e-5),
    Family(name="qwen2_moe", experts_keys=("num_experts", "num_local_experts"),
           intermediate_key="moe_intermediate_size", moe_prefixes=("mlp",),
           split_names=_PROJ_NAMES, qk_norm="none", rope_theta=1e4, rms_eps=1e-6),
    Family(name="qwen3_moe", experts_keys=("num_experts", "num_local_experts"),
           intermediate_key="moe_intermediate_size", moe_prefixes=("mlp",),
           split_names=_PROJ_NAMES, qk_norm="head", rope_theta=1e4, rms_eps=1e-6),
    Family(name="olmoe", experts_keys=("num_experts", "num_local_experts"),
           intermediate_key="intermediate_size", moe_prefixes=("mlp",),
           split_names=_PROJ_NAMES, qk_norm="full", rope_theta=1e4, rms_eps=1e-5),
    Family(name="glm4_moe", experts_keys=("n_routed_experts", "num_local_experts"),
           intermediate_key="moe_intermediate_size", moe_prefixes=("mlp",),
           split_names=_PROJ_NAMES, qk_norm="head", rope_theta=1e4, rms_eps=1e-5,
           sigmoid=True, shared_module="shared_experts"),
    Family(name="minimax_m2", experts_keys=("num_local_experts", "num_experts"),
           intermediate_key="intermediate_size", moe_prefixes=("block_sparse_moe", "mlp"),
           split_names=_W_NAMES, qk_norm="full", rope_theta=1e4, rms_eps=1e-6, sigmoid=True,
           correction="e_score_correction_bias"),
    Family(name="deepseek_v3", experts_keys=("n_routed_experts", "num_local_experts"),
           intermediate_key="moe_intermediate_size", moe_prefixes=("mlp",),
           split_names=_PROJ_NAMES, qk_norm="none", rope_theta=1e4, rms_eps=1e-6,
           sigmoid=True, shared_module="shared_experts"),
    Family(name="gpt_oss", experts_keys=("num_local_experts", "num_experts"),
           intermediate_key="intermediate_size", moe_prefixes=("mlp",),
           split_names=_PROJ_NAMES, qk_norm="none", rope_theta=150000.0, rms_eps=1e-5,
           router="router", default_rope=(
               ("rope_type", "yarn"), ("factor", 32.0), ("beta_fast", 32.0),
               ("beta_slow", 1.0), ("truncate", False),
               ("original_max_position_embeddings", 4096))),
    Family(name="qwen3_next", experts_keys=("num_experts", "num_local_experts"),
           intermediate_key="moe_intermediate_size", moe_prefixes=("mlp",),
           split_names=_PROJ_NAMES, qk_norm="head", rope_theta=1e4, rms_eps=1e-6,
           norm_offset=1.0),
)}


# ---------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def family_of(hf: dict[str, Any]) -> Family:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported families: {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def _field(hf: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` present (and not null) in the HF config."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    raise ValueError(f"config.json: missing field {' / '.join(map(repr, keys))}"
                     + (" (of rope_parameters)" if "rope_type" in hf else ""))


def _reject(condition: bool, field: str, value: Any, why: str) -> None:
    if condition:
        raise ValueError(f"config.json: {field}={value!r} is not supported ({why})")


def _check_supported(hf: dict[str, Any], fam: Family) -> None:
    """Refuse configs whose math the Strata model does not implement."""
    act = hf.get("hidden_act", "silu")
    _reject(act != "silu", "hidden_act", act, "only SwiGLU experts with silu are implemented")
    if fam.name == "mixtral":
        window = hf.get("sliding_window")
        _reject(window is not None, "sliding_window", window, "no sliding-window attention")
    if fam.name in ("qwen2_moe", "qwen3_moe"):
        use_window = hf.get("use_sliding_window", False)
        _reject(bool(use_window), "use_sliding_window", use_window, "no sliding-window attention")
        types = hf.get("layer_types") or []
        _reject("sliding_attention" in types, "layer_types", types, "no sliding-window attention")
        step = hf.get("decoder_sparse_step", 1)
        _reject(step != 1, "decoder_sparse_step", step, "every layer must be an MoE layer")
        dense = hf.get("mlp_only_layers") or []
        _reject(bool(dense), "mlp_only_layers", dense, "every layer must be an MoE layer")
    if fam.name in ("qwen3_moe", "olmoe", "minimax_m2", "deepseek_v3"):
        bias = hf.get("attention_bias", False)
        _reject(bool(bias), "attention_bias", bias, "o_proj bias is not implemented")
    if fam.name == "minimax_m2":
        scoring = hf.get("scoring_func", "sigmoid")
        _reject(scoring != "sigmoid", "scoring_func", scoring, "MiniMax-M2 routes by sigmoid")
        bias = hf.get("use_routing_bias", True)
        _reject(not bias, "use_routing_bias", bias, "the correction bias is always read")
    if fam.name == "gpt_oss":
        types = hf.get("layer_types") or []
        odd = sorted(set(types) - {"sliding_attention", "full_attention"})
        _reject(bool(odd), "layer_types", odd, "sliding and full attention are implemented")
        _reject(len(types) not in (0, hf.get("num_hidden_layers")), "layer_types", types,
                "one entry per layer")
    if fam.name == "qwen3_next":
        _check_qwen3_next(hf)
    if fam.name == "deepseek_v3":
        scoring = hf.get("scoring_func", "sigmoid")
        _reject(scoring != "sigmoid", "scoring_func", scoring, "DeepSeek-V3 routes by sigmoid")
        method = hf.get("topk_method", "noaux_tc")
        _reject(method != "noaux_tc", "topk_method", method, "only noaux_tc routing")


def _check_qwen3_next(hf: dict[str, Any]) -> None:
    step = hf.get("decoder_sparse_step", 1)
    _reject(step != 1, "decoder_sparse_step", step, "every layer must be an MoE layer")
    dense = hf.get("mlp_only_layers") or []
    _reject(bool(dense), "mlp_only_layers", dense, "every layer must be an MoE layer")
    bias = hf.get("attention_bias", False)
    _reject(bool(bias), "attention_bias", bias, "q/k/v/o biases are not implemented here")
    types = _qwen3_next_types(hf)
    odd = sorted(set(types) - {"linear_attention", "full_attention"})
    _reject(bool(odd), "layer_types", odd, "linear and full attention are implemented")
    _reject(len(types) != hf.get("num_hidden_layers"), "layer_types", types,
            "one entry per layer")
    shared = hf.get("shared_expert_intermediate_size")
    _reject(not shared, "shared_expert_intermediate_size", shared,
            "Qwen3-Next's MoE block always has its gated shared expert")


def _qwen3_next_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's token mixer: `layer_types`, or transformers' pattern of every
    `full_attention_interval`-th layer attending."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    interval = int(hf.get("full_attention_interval") or 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(int(_field(hf, "num_hidden_layers")))]


def _rope(hf: dict[str, Any], fam: Family) -> tuple[float, tuple[tuple[str, float], ...] | None]:
    """(rope_theta, YaRN's fields or None) from transformers-5 `rope_parameters` or the older
    top-level fields and `rope_scaling`."""
    params = (hf.get("rope_parameters") or hf.get("rope_scaling") or dict(fam.default_rope))
    if not isinstance(params, dict):
        raise ValueError(f"config.json: rope_parameters={params!r} is not a mapping")
    rope_type = params.get("rope_type", params.get("type", "default"))
    _reject(rope_type not in ("default", "yarn"), "rope_type", rope_type,
            "default RoPE and YaRN are implemented")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    theta = float(fam.rope_theta if theta is None else theta)
    if rope_type != "yarn":
        return theta, None
    for key in ("factor", "original_max_position_embeddings"):
        _field(params, key)
    keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
            "mscale_all_dim", "attention_factor", "truncate")
    return theta, tuple(sorted((k, params[k]) for k in keys if params.get(k) is not None))


def _rotary_dim(hf: dict[str, Any], head_dim: int, default: float | None = None) -> int | None:
    """The rotated dims of a head: MiniMax's `rotary_dim` or `partial_rotary_factor`
    (`default` where neither is named; None: all of them)."""
    params = hf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default))
    if hf.get("rotary_dim") is not None:
        dim = int(hf["rotary_dim"])
    elif factor is not None:
        dim = int(head_dim * float(factor))
    else:
        return None
    return None if dim == head_dim else dim


def _attention_bias(hf: dict[str, Any], fam: Family) -> bool:
    if fam.name == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))
    if fam.name == "mixtral":
        return False
    return bool(hf.get("attention_bias", False))


def source_dtype(hf: dict[str, Any]) -> str:
    """The config's `dtype`/`torch_dtype` when Strata can store it, else float32."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    return name if name in DTYPES else "float32"


def model_config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> ModelConfig:
    """Map a Hugging Face config.json dict onto a ModelConfig, rejecting unsupported math."""
    fam = family_of(hf)
    _check_supported(hf, fam)
    hidden, heads = int(_field(hf, "hidden_size")), int(_field(hf, "num_attention_heads"))
    head_dim = int(hf.get("head_dim") or hidden // heads)
    theta, scaling = _rope(hf, fam)
    clip = hf.get("clip_qkv") if fam.name == "olmoe" else None
    qk_norm = fam.qk_norm
    if fam.name == "glm4_moe" and not hf.get("use_qk_norm", False):
        qk_norm = "none"
    dense = int(hf.get("first_k_dense_replace") or 0) if fam.sigmoid else 0
    fields = dict(
        family=fam.name,
        vocab_size=int(_field(hf, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_field(hf, "num_hidden_layers")) - dense,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        num_experts=int(_field(hf, *fam.experts_keys)),
        top_k=int(_field(hf, "num_experts_per_tok")),
        expert_intermediate_size=int(_field(hf, fam.intermediate_key)),
        norm_topk_prob=True if fam.name == "mixtral"
        else bool(hf.get("norm_topk_prob", False)),  # the sigmoid families': _sigmoid_fields
        qk_norm=qk_norm,
        attention_bias=_attention_bias(hf, fam),
        clip_qkv=None if clip is None else float(clip),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=_rotary_dim(hf, head_dim, 0.25 if fam.name == "qwen3_next" else None),
        rms_eps=float(hf.get("rms_norm_eps") or fam.rms_eps),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype or source_dtype(hf),
        max_position=int(hf["max_position_embeddings"]) if hf.get("max_position_embeddings")
        else None,
        dense_layers=dense,
        dense_intermediate_size=int(hf.get("intermediate_size") or 0) if dense else 0,
    )
    if fam.name == "qwen2_moe":
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        fields.update(shared_intermediate_size=shared, shared_gate=shared > 0)
    if fam.sigmoid:
        fields.update(_sigmoid_fields(hf, fam))
    if fam.name == "deepseek_v3":
        fields.update(_mla_fields(hf))
    if fam.name == "gpt_oss":
        fields.update(_gpt_oss_fields(hf))
    if fam.name == "qwen3_next":
        fields.update(_qwen3_next_fields(hf))
    return ModelConfig(**fields)


def _qwen3_next_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's switches: the gated shared expert, the attention output gate, the
    Gated DeltaNet layers and their head shapes."""
    linear = tuple(i for i, t in enumerate(_qwen3_next_types(hf)) if t == "linear_attention")
    return dict(shared_intermediate_size=int(hf["shared_expert_intermediate_size"]),
                shared_gate=True, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                attention_gate=True, linear_layers=linear,
                linear_conv_kernel=int(hf.get("linear_conv_kernel_dim") or 4),
                linear_key_heads=int(_field(hf, "linear_num_key_heads")),
                linear_value_heads=int(_field(hf, "linear_num_value_heads")),
                linear_key_dim=int(_field(hf, "linear_key_head_dim")),
                linear_value_dim=int(_field(hf, "linear_value_head_dim")))


def _gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS's switches: attention sinks, sliding layers (transformers' alternation, sliding
    first, where `layer_types` is absent), o bias with the q/k/v ones, the biased router and
    experts, the clamped SwiGLU."""
    layers = int(_field(hf, "num_hidden_layers"))
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(layers)]
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = hf.get("sliding_window")
    _reject(bool(sliding) and not window, "sliding_window", window,
            "layer_types names sliding layers, which need a window")
    return dict(scoring="topk_softmax", router_bias=True, attention_sinks=True,
                o_bias=bool(hf.get("attention_bias", True)),
                attention_bias=bool(hf.get("attention_bias", True)),
                sliding_window=int(window) if sliding else None, sliding_layers=sliding,
                expert_bias=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))


def _sigmoid_fields(hf: dict[str, Any], fam: Family) -> dict[str, Any]:
    """Routing (as `SigmoidRouting.from_hf` reads it) and shared-expert fields of the
    sigmoid-routed families."""
    spec = SigmoidRouting.from_hf(hf)
    fields: dict[str, Any] = dict(
        scoring="sigmoid", n_group=spec.n_group, topk_group=spec.topk_group,
        routed_scaling_factor=spec.routed_scaling_factor, norm_topk_prob=spec.norm_topk_prob)
    shared = int(hf.get("n_shared_experts") or 0) if fam.shared_module == "shared_experts" else 0
    if shared:
        fields["shared_intermediate_size"] = shared * int(_field(hf, fam.intermediate_key))
    return fields


def _mla_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention's fields (DeepSeek-V3)."""
    nope, rope = int(_field(hf, "qk_nope_head_dim")), int(_field(hf, "qk_rope_head_dim"))
    return dict(attention="mla", head_dim=nope + rope, num_kv_heads=int(_field(
        hf, "num_attention_heads")), q_lora_rank=hf.get("q_lora_rank") or None,
        kv_lora_rank=int(_field(hf, "kv_lora_rank")), qk_rope_head_dim=rope,
        v_head_dim=int(_field(hf, "v_head_dim")), rotary_dim=None,
        rope_interleave=bool(hf.get("rope_interleave", True)))


# ---------------------------------------------------------------------------------------------
# HF tensor names -> Strata params


@dataclass(frozen=True)
class Ref:
    """One Strata param read from one HF tensor: `how` is copy, transpose ("T"), flatten, or
    "conv" (a depthwise conv1d weight [C, 1, K] read as [K, C])."""

    hf_name: str
    how: str
    shape: tuple[int, ...]  # the Strata shape
    regroup: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None
    """(groups, part sizes, parts kept) of a "T" matrix whose HF output rows are `groups`
    blocks of the parts: the kept parts, each over every group, in that order (a fused
    per-head projection taken apart)."""
    offset: float = 0.0
    """Added to the values read (`Family.norm_offset`)."""

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.how == "T" and self.regroup is not None:
            groups, parts, _ = self.regroup
            return (groups * sum(parts), self.shape[0])
        if self.how == "T":
            return self.shape[::-1]
        if self.how == "flat":
            return (1, *self.shape)
        if self.how == "conv":
            return (self.shape[1], 1, self.shape[0])
        return self.shape


@dataclass(frozen=True)
class MoeLayout:
    """Where one layer's router and experts live: module prefix and expert storage style."""

    prefix: str  # e.g. "model.layers.3.mlp."
    style: str  # "split": one tensor per (expert, kind); "fused": gate_up_proj + down_proj;
    # "interleaved": GPT-OSS's [E, in, out] gate_up_proj (gate, up alternating) + down_proj,
    # each with its bias
    split_names: tuple[str, str, str]
    hf_layer: int  # the HF layer index (MoE layers come after the dense-MLP ones)


_LAYER_HF = {  # under model.layers.N.
    "attn_norm": ("input_layernorm.weight", "copy"),
    "mlp_norm": ("post_attention_layernorm.weight", "copy"),
    "wq": ("self_attn.q_proj.weight", "T"),
    "wk": ("self_attn.k_proj.weight", "T"),
    "wv": ("self_attn.v_proj.weight", "T"),
    "wo": ("self_attn.o_proj.weight", "T"),
    "bq": ("self_attn.q_proj.bias", "copy"),
    "bk": ("self_attn.k_proj.bias", "copy"),
    "bv": ("self_attn.v_proj.bias", "copy"),
    "bo": ("self_attn.o_proj.bias", "copy"),
    "sinks": ("self_attn.sinks", "copy"),
    "q_norm": ("self_attn.q_norm.weight", "copy"),
    "k_norm": ("self_attn.k_norm.weight", "copy"),
    "wq_a": ("self_attn.q_a_proj.weight", "T"),
    "q_a_norm": ("self_attn.q_a_layernorm.weight", "copy"),
    "wq_b": ("self_attn.q_b_proj.weight", "T"),
    "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", "T"),
    "kv_a_norm": ("self_attn.kv_a_layernorm.weight", "copy"),
    "wkv_b": ("self_attn.kv_b_proj.weight", "T"),
    "ffn_w1": ("mlp.gate_proj.weight", "T"),
    "ffn_w3": ("mlp.up_proj.weight", "T"),
    "ffn_w2": ("mlp.down_proj.weight", "T"),
}


def _moe_hf(fam: Family) -> dict[str, tuple[str, str]]:
    """Strata param -> (tensor under the MoE module, how) of the family's MoE params."""
    shared = fam.shared_module
    return {
        "router": (f"{fam.router}.weight", "T"),
        "router_bias": (f"{fam.router}.bias", "copy"),
        "router_correction": (fam.correction, "copy"),
        "shared_w1": (f"{shared}.gate_proj.weight", "T"),
        "shared_w3": (f"{shared}.up_proj.weight", "T"),
        "shared_w2": (f"{shared}.down_proj.weight", "T"),
        "shared_gate": ("shared_expert_gate.weight", "flat"),
    }


def detect_layout(fam: Family, names: Container[str], hf_layer: int) -> MoeLayout:
    """Pick the MoE module prefix and expert style present for HF layer `hf_layer`."""
    base = f"model.layers.{hf_layer}."
    prefix = next(
        (f"{base}{p}." for p in fam.moe_prefixes if f"{base}{p}.{fam.router}.weight" in names),
        f"{base}{fam.moe_prefixes[0]}.",
    )
    if fam.name == "gpt_oss":  # MXFP4 experts read as the float tensors they encode
        return MoeLayout(prefix, "interleaved", fam.split_names, hf_layer)
    if f"{prefix}experts.gate_up_proj" in names:
        return MoeLayout(prefix, "fused", fam.split_names, hf_layer)
    for split in (fam.split_names, _W_NAMES, _PROJ_NAMES):
        if f"{prefix}experts.0.{split[0]}.weight" in names:
            return MoeLayout(prefix, "split", split, hf_layer)
    return MoeLayout(prefix, "split", fam.split_names, hf_layer)


_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm")
"""The RMSNorm weights that `Family.norm_offset` shifts (not the gated norm of a linear
layer, which scales by its weight)."""


def _offset(fam: Family, name: str) -> float:
    return fam.norm_offset if name in _NORMS else 0.0


def _layer_ref(cfg: ModelConfig, fam: Family, base: str, name: str,
               shape: tuple[int, ...]) -> Ref:
    """The HF source of a layer param of `_LAYER_HF` (or the attention gate, which Qwen3-Next
    keeps per head beside the query in q_proj: [q, gate] per head)."""
    suffix, how = _LAYER_HF["wq" if name == "wgate" else name]
    regroup = None
    if name in ("wq", "wgate") and cfg.attention_gate:
        regroup = (cfg.num_heads, (cfg.head_dim,) * 2, (int(name == "wgate"),))
    return Ref(base + suffix, how, shape, regroup, _offset(fam, name))


def dense_refs(cfg: ModelConfig, fam: Family, layout: MoeLayout) -> dict[str, Ref]:
    """Strata dense param -> HF tensor it comes from, for one MoE layer."""
    base, moe = f"model.layers.{layout.hf_layer}.", _moe_hf(fam)
    refs = {}
    for name, shape in dense_layer_shapes(cfg).items():
        if name in _LAYER_HF or name == "wgate":
            refs[name] = _layer_ref(cfg, fam, base, name, shape)
        elif name in moe:
            suffix, how = moe[name]
            refs[name] = Ref(layout.prefix + suffix, how, shape)
        else:
            raise ValueError(f"no Hugging Face source for Strata param {name!r}")
    return refs


def mixer_refs(cfg: ModelConfig, fam: Family, hf_layer: int) -> tuple[str, dict[str, Ref]]:
    """(kind, Strata param -> HF tensor) of the token mixer of HF layer `hf_layer` of a model
    with linear layers: its gated attention (q_proj's per-head [q, gate] taken apart) or its
    Gated DeltaNet (the per-key-head [q, k, v, z] and [b, a] of its input projections laid
    out part-major, `config.linear_layer_shapes`)."""
    base = f"model.layers.{hf_layer}."
    if hf_layer not in cfg.linear_layers:
        return "attn", {name: _layer_ref(cfg, fam, base, name, shape)
                        for name, (shape, _) in mixer_arrays(cfg, "attn").items()}
    kh, dk, dv = cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_dim
    per = cfg.linear_value_heads // kh
    shapes = {k: v[0] for k, v in mixer_arrays(cfg, "linear").items()}
    lin = base + "linear_attn."
    return "linear", {
        "w_qkvz": Ref(lin + "in_proj_qkvz.weight", "T", shapes["w_qkvz"],
                      (kh, (dk, dk, per * dv, per * dv), (0, 1, 2, 3))),
        "w_ba": Ref(lin + "in_proj_ba.weight", "T", shapes["w_ba"], (kh, (per, per), (0, 1))),
        "conv": Ref(lin + "conv1d.weight", "conv", shapes["conv"]),
        "a_log": Ref(lin + "A_log", "copy", shapes["a_log"]),
        "dt_bias": Ref(lin + "dt_bias", "copy", shapes["dt_bias"]),
        "out_norm": Ref(lin + "norm.weight", "copy", shapes["out_norm"]),
        "w_out": Ref(lin + "out_proj.weight", "T", shapes["w_out"]),
    }


def mixer_indices(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(MoE layer, index among its kind) of each token mixer stored apart (`mixer_refs`)."""
    if not mixer_counts(cfg)["linear"]:
        return []
    _, slots = cfg.mixer_slots()
    return list(enumerate(slots))


def mlp_refs(cfg: ModelConfig, hf_layer: int) -> dict[str, Ref]:
    """Strata param -> HF tensor, for the dense-MLP layer at HF layer `hf_layer`."""
    base = f"model.layers.{hf_layer}."
    return {name: Ref(base + _LAYER_HF[name][0], _LAYER_HF[name][1], shape)
            for name, shape in mlp_layer_shapes(cfg).items()}


def expert_tensors(cfg: ModelConfig, layout: MoeLayout) -> dict[str, tuple[int, ...]]:
    """HF expert tensor names of one layer -> their expected HF shapes."""
    d, f, n = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    if layout.style == "interleaved":
        return {
            f"{layout.prefix}experts.gate_up_proj": (n, d, 2 * f),
            f"{layout.prefix}experts.gate_up_proj_bias": (n, 2 * f),
            f"{layout.prefix}experts.down_proj": (n, f, d),
            f"{layout.prefix}experts.down_proj_bias": (n, d),
        }
    if layout.style == "fused":
        return {
            f"{layout.prefix}experts.gate_up_proj": (n, 2 * f, d),
            f"{layout.prefix}experts.down_proj": (n, d, f),
        }
    return {
        f"{layout.prefix}experts.{e}.{hf_kind}.weight": expert_shape(cfg, kind)[::-1]
        for e in range(n)
        for kind, hf_kind in zip(EXPERT_KINDS, layout.split_names, strict=True)
    }


def global_refs(cfg: ModelConfig, fam: Family | None = None) -> dict[str, Ref]:
    names = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
             "lm_head": "lm_head.weight"}  # fmt: skip
    offset = 0.0 if fam is None else fam.norm_offset
    return {k: Ref(names[k], "copy", shape, offset=offset if k == "final_norm" else 0.0)
            for k, shape in global_shapes(cfg).items()}


_MTP_HF = {  # under model.layers.N. of a multi-token-prediction module
    "enorm": ("enorm.weight", "copy"),
    "hnorm": ("hnorm.weight", "copy"),
    "eh_proj": ("eh_proj.weight", "T"),
    "head_norm": ("shared_head.norm.weight", "copy"),
}
_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_count(cfg: ModelConfig, names: Container[str]) -> int:
    """The multi-token-prediction modules the source holds: layers from the decoder's end on
    that have an `eh_proj`."""
    n = 0
    while f"model.layers.{cfg.total_layers + n}.eh_proj.weight" in names:
        n += 1
    return n


def mtp_refs(cfg: ModelConfig, fam: Family, layout: MoeLayout) -> dict[str, Ref]:
    """Strata param -> HF tensor, for the MTP module at HF layer `layout.hf_layer`."""
    base = f"model.layers.{layout.hf_layer}."
    refs = dense_refs(cfg, fam, layout)
    shapes = mtp_layer_shapes(cfg)
    refs.update({name: Ref(base + suffix, how, shapes[name])
                 for name, (suffix, how) in _MTP_HF.items()})
    return refs


def shared_copies(cfg: ModelConfig) -> set[str]:
    """The MTP modules' copies of the embedding and the output head (DeepSeek-V3 shares them
    with the model): left out, the model's own are used."""
    return {f"model.layers.{cfg.total_layers + i}.{name}" for i in range(cfg.mtp_layers)
            for name in _SHARED_COPIES}
