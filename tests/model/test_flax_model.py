"""The Flax model: `init` lays out the tree a checkpoint loads into (every family, float and
int8 dense), `apply` is the step's forward bit for bit, and experts are never params."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax import api
from strata_jax.formats.checkpoint import (
    EXPERT_KINDS,
    INT8_MATRICES,
    CheckpointReader,
    CheckpointWriter,
    global_shapes,
)
from strata_jax.model.flax_model import MoEModel, dense_quant, layer_specs
from strata_jax.step import programs as step
from tests.helpers import random_arrays, random_model, tiny_config, write_checkpoint

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
INT8 = {"dense": "int8", "experts": "none"}


def init_shapes(cfg, dense="none"):
    """The tree `init` makes, as shapes and dtypes (traced, not run)."""
    return jax.eval_shape(functools.partial(api.init_params, cfg, dense=dense),
                          jax.random.key(0))


def write_int8_checkpoint(cfg, dst) -> None:
    """A checkpoint with int8 dense matrices and bf16 per-channel scales, float experts."""
    g, layers, experts = random_arrays(cfg)
    rng = np.random.default_rng(0)
    with CheckpointWriter(dst, cfg, quantization=INT8) as w:
        w.write_globals(g)
        for i in range(cfg.num_layers):
            lp = {k: v[i] for k, v in layers.items()}
            for name in INT8_MATRICES:
                if name in lp:
                    lp[name] = rng.integers(-127, 128, lp[name].shape).astype(np.int8)
                    lp[f"{name}_scale"] = np.full(lp[name].shape[-1], 0.01, np.float32)
            w.write_layer_dense(i, lp)
            for e in range(cfg.num_experts):
                for kind, arr in experts.items():
                    w.write_expert(i, e, kind, arr[i, e])
        w.commit()


@pytest.mark.parametrize("family,dtype", [(f, "float32") for f in FAMILIES]
                         + [("qwen2_moe", "bfloat16")])
def test_init_tree_is_the_checkpoint_tree(tmp_path, family, dtype):
    cfg = tiny_config(family, dtype=dtype)
    write_checkpoint(cfg, tmp_path / "ckpt")
    loaded = api.read_dense_params(CheckpointReader(tmp_path / "ckpt"))
    chex.assert_trees_all_equal_shapes_and_dtypes(init_shapes(cfg), loaded)
    chex.assert_tree_shape_prefix(loaded["params"]["layers"], (cfg.num_layers,))
    assert dense_quant(loaded) == "none"


def test_init_tree_is_the_int8_checkpoint_tree(tmp_path):
    """qwen2_moe: int8 attention and shared-expert matrices with bf16 scales beside float32
    norms, biases, router and shared gate."""
    cfg = tiny_config("qwen2_moe")
    write_int8_checkpoint(cfg, tmp_path / "ckpt")
    loaded = api.read_dense_params(CheckpointReader(tmp_path / "ckpt"))
    chex.assert_trees_all_equal_shapes_and_dtypes(init_shapes(cfg, "int8"), loaded)
    layers = loaded["params"]["layers"]
    assert layers["wqkv"].dtype == jnp.int8 and layers["wqkv_scale"].dtype == jnp.bfloat16
    assert layers["bqkv"].dtype == jnp.float32
    assert dense_quant(loaded) == "int8"


def test_init_values():
    """A real `init`: the loaded tree's layout, norms at 1, each layer drawn apart."""
    cfg = tiny_config("olmoe")
    params = api.init_params(cfg, jax.random.key(0))
    chex.assert_trees_all_equal_shapes_and_dtypes(params, random_model(cfg).params)
    chex.assert_tree_all_finite(params)
    layers = params["params"]["layers"]
    np.testing.assert_array_equal(layers["attn_norm"], 1.0)
    assert not np.array_equal(layers["wqkv"][0], layers["wqkv"][1])


def test_apply_gives_the_step_forward_bits():
    cfg = tiny_config("qwen2_moe")
    m = random_model(cfg, seed=4)
    tiers = step.resident_tiers(m.slot_table)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 7)).astype(np.int32)
    ref, record = step.forward(cfg, step.StepPlan(), m.params, m.experts, tiers, tokens)
    apply = jax.jit(MoEModel(cfg, step.StepPlan()).apply,
                    compiler_options=step.COMPILER_OPTIONS)
    logits, fields = apply(m.params, tokens, m.experts, tiers)
    chex.assert_shape(logits, (2, 7, cfg.vocab_size))
    chex.assert_trees_all_equal(logits, ref)
    chex.assert_trees_all_equal(fields, dict(record.items()))
    chex.assert_shape(fields["experts"], (cfg.num_layers, tokens.size, cfg.top_k))


@pytest.mark.parametrize("family", FAMILIES)
def test_params_hold_no_experts(family):
    """The dense params are exactly the globals and the layer specs; no array has an expert's
    width (`expert_intermediate_size`) or a leading experts axis: the pool is a call argument."""
    cfg = tiny_config(family)
    params = init_shapes(cfg)["params"]
    assert set(params) == set(global_shapes(cfg)) | {"layers"}
    assert set(params["layers"]) == set(layer_specs(cfg))
    assert not set(params["layers"]) & set(EXPERT_KINDS)
    widths = {cfg.expert_intermediate_size, cfg.num_layers * cfg.num_experts}
    for leaf in jax.tree.leaves(params):
        assert not widths & set(leaf.shape), leaf.shape


def test_apply_refuses_params_of_another_dense_quantization():
    """An int8 tree applied as float (or the reverse) would misread the int8 codes."""
    cfg = tiny_config()
    m = random_model(cfg)
    module = MoEModel(cfg, step.StepPlan(), "int8")
    tokens = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="do not match dense='int8'"):
        jax.eval_shape(module.apply, m.params, tokens, m.experts,
                       step.resident_tiers(m.slot_table))
