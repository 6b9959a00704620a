"""Small random models shared by the tests (built in milliseconds, never all-zero)."""

from __future__ import annotations

import numpy as np

from strata_jax import api
from strata_jax.formats.checkpoint import (
    EXPERT_KINDS,
    CheckpointWriter,
    dense_layer_shapes,
    expert_bias_shapes,
    expert_shape,
    global_shapes,
    mixer_arrays,
    mixer_counts,
    mlp_layer_shapes,
)
from strata_jax.formats.config import ModelConfig


def tiny_config(family: str = "mixtral", **changes) -> ModelConfig:
    base = dict(
        family=family, vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, num_experts=6, top_k=2, expert_intermediate_size=24,
    )  # fmt: skip
    if family == "qwen2_moe":
        base.update(shared_intermediate_size=16, shared_gate=True, attention_bias=True,
                    norm_topk_prob=False)
    elif family == "qwen3_moe":
        base.update(qk_norm="head")
    elif family == "olmoe":
        base.update(qk_norm="full", clip_qkv=2.0, norm_topk_prob=False)
    elif family == "glm4_moe":
        base.update(qk_norm="head", rotary_dim=4, attention_bias=True, scoring="sigmoid",
                    n_group=2, topk_group=1, routed_scaling_factor=2.5,
                    shared_intermediate_size=16, dense_layers=1, dense_intermediate_size=40)
    elif family == "minimax_m2":
        base.update(qk_norm="full", rotary_dim=4, scoring="sigmoid")
    elif family == "deepseek_v3":
        base.update(attention="mla", num_kv_heads=4, head_dim=12, q_lora_rank=16,
                    kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8, rope_interleave=True,
                    rope_scaling=(("beta_fast", 32), ("beta_slow", 1), ("factor", 4.0),
                                  ("mscale", 1.0), ("mscale_all_dim", 1.0),
                                  ("original_max_position_embeddings", 16)),
                    scoring="sigmoid", n_group=3, topk_group=2, routed_scaling_factor=2.5,
                    shared_intermediate_size=16, dense_layers=1, dense_intermediate_size=40)
    elif family == "gpt_oss":
        base.update(attention_bias=True, o_bias=True, attention_sinks=True, sliding_window=3,
                    sliding_layers=(0,), scoring="topk_softmax", router_bias=True,
                    expert_bias=True, swiglu_limit=1.0,
                    rope_scaling=(("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 4.0),
                                  ("original_max_position_embeddings", 8), ("truncate", False)))
    elif family == "qwen3_next":
        base.update(num_layers=3, linear_layers=(0, 1), qk_norm="head", rotary_dim=4,
                    attention_gate=True, shared_intermediate_size=16, shared_gate=True,
                    linear_key_heads=2, linear_value_heads=4, linear_key_dim=8,
                    linear_value_dim=6, linear_conv_kernel=4)
    base.update(changes)
    return ModelConfig(**base)


def random_arrays(cfg: ModelConfig, seed: int = 0, scale: float = 0.3):
    """(globals, stacked layers, experts [L, E, in, out]) as float32 numpy arrays."""
    rng = np.random.default_rng(seed)

    def draw(shape):
        if len(shape) == 1:
            return (1.0 + 0.1 * rng.normal(size=shape)).astype(np.float32)
        return rng.normal(0, scale, shape).astype(np.float32)

    g = {k: draw(s) for k, s in global_shapes(cfg).items()}
    layers = {
        k: np.stack([draw(s) for _ in range(cfg.num_layers)])
        for k, s in dense_layer_shapes(cfg).items()
    }
    experts = {
        k: rng.normal(0, scale, (cfg.num_layers, cfg.num_experts, *expert_shape(cfg, k)))
        .astype(np.float32)
        for k in EXPERT_KINDS
    }
    for k, shape in expert_bias_shapes(cfg).items():
        experts[k] = rng.normal(0, scale, (cfg.num_layers, cfg.num_experts, *shape)).astype(
            np.float32)
    return g, layers, experts


def random_mlp_layers(cfg: ModelConfig, seed: int = 0, scale: float = 0.3):
    """The dense-MLP layers' params (`ModelConfig.dense_layers`), stacked, float32."""
    rng = np.random.default_rng(seed + 1000)
    return {k: (1.0 + 0.1 * rng.normal(size=(cfg.dense_layers, *s)) if len(s) == 1
                else rng.normal(0, scale, (cfg.dense_layers, *s))).astype(np.float32)
            for k, s in mlp_layer_shapes(cfg).items()}


def random_mixers(cfg: ModelConfig, seed: int = 0, scale: float = 0.3):
    """The token mixers' params of a model with linear layers, per kind stacked over its
    layers, float32 (none without linear layers)."""
    rng = np.random.default_rng(seed + 2000)
    return {kind: {k: (1.0 + 0.1 * rng.normal(size=(n, *s)) if len(s) == 1
                       else rng.normal(0, scale, (n, *s))).astype(np.float32)
                   for k, (s, _) in mixer_arrays(cfg, kind).items()}
            for kind, n in mixer_counts(cfg).items() if n}


def random_model(cfg: ModelConfig, seed: int = 0) -> api.Model:
    return api.from_arrays(cfg, *random_arrays(cfg, seed), random_mlp_layers(cfg, seed),
                           random_mixers(cfg, seed))


def write_checkpoint(cfg: ModelConfig, dst, seed: int = 0, **writer_kw):
    """Write `random_arrays(cfg, seed)` as a Strata checkpoint; returns the arrays."""
    g, layers, experts = random_arrays(cfg, seed)
    mlp = random_mlp_layers(cfg, seed)
    with CheckpointWriter(dst, cfg, **writer_kw) as w:
        w.write_globals(g)
        for i in range(cfg.dense_layers):
            w.write_mlp_layer(i, {k: v[i] for k, v in mlp.items()})
        for kind, stack in random_mixers(cfg, seed).items():
            for i in range(mixer_counts(cfg)[kind]):
                w.write_mixer(kind, i, {k: v[i] for k, v in stack.items()})
        for i in range(cfg.num_layers):
            w.write_layer_dense(i, {k: v[i] for k, v in layers.items()})
            for e in range(cfg.num_experts):
                for kind, arr in experts.items():
                    w.write_expert(i, e, kind, arr[i, e])
        w.commit()
    return g, layers, experts


def write_quantized_checkpoint(root, seed: int = 4, **changes):
    """A random tiny Mixtral (its dims multiples of 128, `changes` applied) written under
    root/"float" and quantized to int8 dense + int4-rtn g128 experts under root/"q", which
    is returned."""
    from strata_jax.tools.quantize import quantize_checkpoint

    cfg = tiny_config("mixtral", **{"hidden_size": 128, "expert_intermediate_size": 128,
                                    "head_dim": 32, **changes})
    write_checkpoint(cfg, root / "float", seed=seed)
    quantize_checkpoint(root / "float", root / "q", experts="int4-rtn", dense="int8",
                        progress=False)
    return root / "q"
