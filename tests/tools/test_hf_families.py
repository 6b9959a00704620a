"""The 2026 families through `strata convert hf`: tiny random DeepSeek-V3, GLM-4.5 (glm4_moe)
and MiniMax-M2 models made with transformers and saved with `save_pretrained`, in several
shapes each, convert and reproduce transformers' logits and greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import strata_jax  # noqa: E402
from strata_jax.tools.hf_convert import convert_hf  # noqa: E402
from strata_runtime.cli import main as cli  # noqa: E402
from tests.tools.test_hf_convert import (  # noqa: E402
    GEN_PROMPTS,
    PROMPTS,
    assert_logits_close,
    hf_generate,
    hf_logits,
)

BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_experts_per_tok=2, eos_token_id=None, pad_token_id=0, bos_token_id=None)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
SHAPES = {
    # DeepSeek-V3: q-LoRA or not, groups, 1 or 2 shared experts, 0 or 1 dense layers, YaRN
    "deepseek_v3-qlora": ("deepseek_v3", dict(
        n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, num_key_value_heads=4, rope_parameters=YARN,
        max_position_embeddings=32)),
    "deepseek_v3-plain": ("deepseek_v3", dict(
        n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=2,
        first_k_dense_replace=0, n_group=1, topk_group=1, routed_scaling_factor=1.5,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_key_value_heads=4, norm_topk_prob=False, tie_word_embeddings=True,
        rope_interleave=False)),
    # GLM-4.5: partial rotary, q/k norm or not, qkv bias, groups, a dense first layer
    "glm4_moe": ("glm4_moe", dict(
        n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        num_key_value_heads=2, head_dim=16, use_qk_norm=True, attention_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                             partial_rotary_factor=0.5))),
    "glm4_moe-nonorm": ("glm4_moe", dict(
        n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=2,
        first_k_dense_replace=0, n_group=1, topk_group=1, num_key_value_heads=2,
        use_qk_norm=False, tie_word_embeddings=True)),
    # MiniMax-M2: full q/k norm, partial rotary through `rotary_dim`, no shared expert
    "minimax_m2": ("minimax_m2", dict(
        num_local_experts=8, intermediate_size=32, num_key_value_heads=2, head_dim=16,
        rotary_dim=8)),
}
ROUTING_MARGIN = 1e-4


def build(shape: str, seed: int = 0, **overrides):
    """A tiny float32 model whose routing has a margin on PROMPTS (see test_hf_convert's
    `build_model`), its correction biases non-zero so they must steer the choice."""
    family, kw = SHAPES[shape]
    cfg = transformers.AutoConfig.for_model(family, **{**BASE, **kw, **overrides})
    for draw in range(seed, seed + 50):
        torch.manual_seed(draw)
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=torch.float32, experts_implementation="eager")
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name
                        else 0.15 * torch.randn_like(p))
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.1 * torch.randn_like(b))
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        if sigmoid_margin(model.eval(), cfg) >= ROUTING_MARGIN:
            return model
    raise AssertionError(f"{shape}: 50 draws all route PROMPTS within a tie")


def sigmoid_margin(model, cfg) -> float:
    """Smallest gap, over tokens and MoE layers, at the two cuts of grouped sigmoid routing:
    between the kept and the first dropped group's rating, and between the k-th and the
    (k+1)-th biased score of the kept groups (float64)."""
    n_group = getattr(cfg, "n_group", None) or 1
    topk_group = getattr(cfg, "topk_group", None) or n_group
    k, gaps = cfg.num_experts_per_tok, []

    def hook(module, _inputs, out):
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is None:  # MiniMax-M2 keeps it on the MoE block
            bias = blocks[module].e_score_correction_bias
        biased = torch.sigmoid(out[0].double()) + bias.double()
        grouped = biased.view(biased.shape[0], n_group, -1)
        if n_group > 1:
            rating = grouped.topk(2, dim=-1).values.sum(-1)
            top = rating.topk(topk_group + 1, dim=-1).values
            gaps.append(float((top[:, -2] - top[:, -1]).min()))
            kept = rating.topk(topk_group, dim=-1).indices
            mask = torch.zeros_like(rating, dtype=torch.bool).scatter_(1, kept, True)
            grouped = grouped.masked_fill(~mask[..., None], -1e9)
        top = grouped.reshape(biased.shape[0], -1).topk(k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    blocks = {m.gate: m for n, m in model.named_modules() if hasattr(m, "gate")
              and hasattr(m, "experts")}
    handles = [g.register_forward_hook(hook) for g in blocks]
    try:
        hf_logits(model, PROMPTS)
    finally:
        for h in handles:
            h.remove()
    assert gaps, "router modules not found"
    return min(gaps)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def case(request, tmp_path_factory):
    shape = request.param
    root = tmp_path_factory.mktemp(shape)
    hf = build(shape)
    hf.save_pretrained(root / "hf")
    assert cli.main(["convert", "hf", str(root / "hf"), str(root / "strata")]) == 0
    return shape, hf, strata_jax.load(root / "strata"), root


def test_logits_and_greedy_tokens_match_transformers(case):
    shape, hf, model, _ = case
    assert model.config.family == SHAPES[shape][0]
    assert_logits_close(strata_jax.logits(model, PROMPTS), hf_logits(hf, PROMPTS))
    assert strata_jax.generate(model, GEN_PROMPTS, 12) == hf_generate(hf, GEN_PROMPTS, 12)


def test_config_maps_every_switch(case):
    shape, hf, model, _ = case
    cfg, src = model.config, hf.config
    assert cfg.scoring == "sigmoid" and cfg.total_layers == src.num_hidden_layers
    assert cfg.dense_layers == (getattr(src, "first_k_dense_replace", 0) or 0)
    if shape.startswith("deepseek"):
        assert cfg.attention == "mla" and cfg.q_lora_rank == src.q_lora_rank
        assert cfg.shared_intermediate_size == src.n_shared_experts * src.moe_intermediate_size
        assert (cfg.rope_scaling is not None) == ("rope_type" in str(SHAPES[shape][1]))
    if shape == "glm4_moe":
        assert (cfg.rotary_dim, cfg.qk_norm, cfg.n_group) == (8, "head", 2)
    if shape == "minimax_m2":
        assert (cfg.rotary_dim, cfg.qk_norm, cfg.shared_intermediate_size) == (8, "full", 0)


def test_routing_params_stay_float32_in_a_bfloat16_checkpoint(case):
    """The router and its correction bias keep float32 (transformers does): bf16 would round
    the biased scores the experts are chosen by."""
    shape, hf, _, root = case
    if shape != "glm4_moe":
        pytest.skip("one family is enough")
    dst = root / "bf16"
    assert cli.main(["convert", "hf", str(root / "hf"), str(dst), "--dtype", "bfloat16"]) == 0
    model = strata_jax.load(dst)
    layers = model.params["params"]["layers"]
    assert layers["router_correction"].dtype == np.float32
    assert layers["router"].dtype == np.float32 and layers["wqkv"].dtype != np.float32
    got, ref = strata_jax.logits(model, PROMPTS), hf_logits(hf, PROMPTS)
    assert np.linalg.norm(got - ref) <= 5e-2 * np.linalg.norm(ref)


def test_an_incomplete_mtp_module_is_named(case):
    """A layer past the decoder with an `eh_proj` is an MTP module (kept: tests/model/
    test_mtp.py); one missing its tensors is refused by name, and nothing is written."""
    shape, hf, _, root = case
    if shape != "deepseek_v3-qlora":
        pytest.skip("one family is enough")
    from safetensors.numpy import load_file, save_file

    src = root / "mtp"
    hf.save_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    last = hf.config.num_hidden_layers
    tensors[f"model.layers.{last}.eh_proj.weight"] = np.ones((64, 128), np.float32)
    tensors[f"model.layers.{last}.enorm.weight"] = np.ones((64,), np.float32)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing tensors .*model.layers.{last}"):
        convert_hf(src, root / "mtp.strata")
    assert not (root / "mtp.strata").exists()
