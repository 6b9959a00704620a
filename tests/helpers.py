"""Small random models shared by the tests (built in milliseconds, never all-zero)."""

from __future__ import annotations

import numpy as np

from strata_jax import api
from strata_jax.formats.checkpoint import (
    EXPERT_KINDS,
    CheckpointWriter,
    dense_layer_shapes,
    expert_shape,
    global_shapes,
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
    return g, layers, experts


def random_model(cfg: ModelConfig, seed: int = 0) -> api.Model:
    return api.from_arrays(cfg, *random_arrays(cfg, seed))


def write_checkpoint(cfg: ModelConfig, dst, seed: int = 0, **writer_kw):
    """Write `random_arrays(cfg, seed)` as a Strata checkpoint; returns the arrays."""
    g, layers, experts = random_arrays(cfg, seed)
    with CheckpointWriter(dst, cfg, **writer_kw) as w:
        w.write_globals(g)
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
