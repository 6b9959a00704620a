"""Qwen3-Next through `strata convert hf`: tiny random `Qwen3NextForCausalLM`s made with
transformers and saved with `save_pretrained` (full attention every 2nd or every 4th layer,
Gated DeltaNet layers with more value heads than key heads or as many, many experts top-k
beside the gated shared expert) convert and reproduce transformers' logits and greedy
tokens, prefilled whole or in chunks; offloaded, the engine gives the resident bits."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import strata_jax  # noqa: E402
from strata_jax.tools.hf_convert import model_config_from_hf  # noqa: E402
from strata_runtime.cli import main as cli  # noqa: E402
from tests.tools.test_hf_convert import (  # noqa: E402
    assert_logits_close,
    hf_greedy,
    hf_logits,
    logit_margin,
)

BASE = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=64, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=64,
            eos_token_id=None, pad_token_id=0, bos_token_id=None)
SHAPES = {
    # attention every 2nd layer; two value heads per key head; partial rotary 1/4
    "interval-2": dict(num_hidden_layers=4, full_attention_interval=2),
    # attention every 4th layer; as many value heads as key heads; 16 experts top-4; rotary 1/2
    "interval-4": dict(num_hidden_layers=4, full_attention_interval=4, linear_num_value_heads=2,
                       num_experts=16, num_experts_per_tok=4, partial_rotary_factor=0.5),
}
PROMPTS = np.random.default_rng(7).integers(0, 128, size=(2, 13)).tolist()
GEN_PROMPTS = [PROMPTS[0][:6], PROMPTS[1]]
NEW = 8
ROUTING_MARGIN = 1e-4


def build(shape: str, seed: int = 0):
    """A tiny float32 Qwen3-Next with every weight random (the (1 + w) norms near 1, the
    decay's A in [0.5, 2]), redrawn until no token of PROMPTS routes within ROUTING_MARGIN of
    a tie."""
    cfg = transformers.Qwen3NextConfig(**{**BASE, **SHAPES[shape]})
    for draw in range(seed, seed + 50):
        torch.manual_seed(draw)
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=torch.float32, experts_implementation="eager")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("linear_attn.norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif "norm" in name:  # scales by 1 + weight
                    p.copy_(0.1 * torch.randn_like(p))
                elif name.endswith("A_log"):
                    p.copy_(torch.empty_like(p).uniform_(0.5, 2.0).log())
                else:
                    p.copy_(0.15 * torch.randn_like(p))
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        if routing_margin(model.eval()) >= ROUTING_MARGIN:
            return model
    raise AssertionError(f"{shape}: 50 draws all route PROMPTS within a tie")


def routing_margin(model) -> float:
    """Smallest gap between the k-th and (k+1)-th router logit over PROMPTS' tokens."""
    return logit_margin(model, PROMPTS, "mlp.gate")


@pytest.fixture(scope="module", params=sorted(SHAPES))
def case(request, tmp_path_factory):
    shape = request.param
    root = tmp_path_factory.mktemp(shape)
    hf = build(shape)
    hf.save_pretrained(root / "hf")
    assert cli.main(["convert", "hf", str(root / "hf"), str(root / "strata")]) == 0
    return shape, hf, strata_jax.load(root / "strata"), root


def test_config_maps_every_switch(case):
    _, hf, model, _ = case
    cfg, src = model.config, hf.config
    linear = tuple(i for i, t in enumerate(src.layer_types) if t == "linear_attention")
    assert cfg.family == "qwen3_next" and cfg.linear_layers == linear
    assert cfg.attention_layers == src.num_hidden_layers - len(linear) > 0
    assert cfg.attention_gate and cfg.shared_gate and cfg.qk_norm == "head"
    assert cfg.shared_intermediate_size == src.shared_expert_intermediate_size
    assert (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim,
            cfg.linear_value_dim, cfg.linear_conv_kernel) == (
        src.linear_num_key_heads, src.linear_num_value_heads, src.linear_key_head_dim,
        src.linear_value_head_dim, src.linear_conv_kernel_dim)
    factor = src.rope_parameters["partial_rotary_factor"]
    assert cfg.rope_dim == int(src.head_dim * factor)


def test_logits_match_transformers(case):
    _, hf, model, _ = case
    assert_logits_close(strata_jax.logits(model, PROMPTS), hf_logits(hf, PROMPTS))


@pytest.mark.parametrize("chunk", [None, 8])
def test_greedy_tokens_match_transformers(case, chunk):
    """Whole prompts, or prefilled in chunks of 8 (the 13-token prompt in two: the second
    chunk starts from the conv and recurrent states the first left)."""
    _, hf, model, _ = case
    ref = [hf_greedy(hf, p, NEW) for p in GEN_PROMPTS]
    got = strata_jax.generate(model, GEN_PROMPTS, NEW, batch_capacity=2, max_len=32,
                              prefill_chunk=chunk)
    assert got == ref


def test_unsupported_switches_are_refused_by_name(case):
    shape, hf, _, _ = case
    if shape != "interval-2":
        pytest.skip("one shape is enough")
    src = hf.config.to_dict()
    for field, value in (("mlp_only_layers", [1]), ("decoder_sparse_step", 2),
                         ("attention_bias", True),
                         ("layer_types", ["sliding_attention"] * 4)):
        with pytest.raises(ValueError, match=field):
            model_config_from_hf({**src, field: value})


def test_a_row_reused_by_another_prompt_starts_from_zero_state(case):
    """Batch invariance with recurrent state: a prompt generated beside another, or after
    another in the same row (its states overwritten, not carried over), gives transformers'
    tokens of it alone."""
    shape, hf, model, _ = case
    if shape != "interval-4":
        pytest.skip("one shape is enough")
    got = strata_jax.generate(model, GEN_PROMPTS[::-1] + [GEN_PROMPTS[1]], NEW,
                              batch_capacity=2, max_len=32)
    assert got[0] == got[2] == hf_greedy(hf, GEN_PROMPTS[1], NEW)


def _engine_rows(path, **knobs):
    from strata_jax.formats.checkpoint import CheckpointReader
    from strata_runtime.engine.config import EngineConfig
    from strata_runtime.engine.offload import Engine
    from tests.runtime.contract import run_rows

    config = EngineConfig(batch_capacity=2, max_len=32, prefill_chunk=8, **knobs)
    with Engine(CheckpointReader(path), config) as engine:
        tokens, logits = run_rows(engine, GEN_PROMPTS, 6)
        return tokens, logits, engine.stats()


def test_offloaded_decode_is_the_resident_bits_and_transformers_logits(case):
    """The engine prefills in chunks of 8 and decodes: every decode step's logits are
    transformers' over the whole sequence, and with a quarter of the experts in HBM (the
    rest copied in from the host tier) the same bits."""
    shape, hf, model, root = case
    if shape != "interval-2":
        pytest.skip("one shape is enough")
    tokens, logits, _ = _engine_rows(root / "strata")
    for row, prompt in enumerate(GEN_PROMPTS):
        seq = prompt + tokens[row].tolist()
        ref = hf_logits(hf, [seq])[0, len(prompt):len(seq) - 1]
        assert_logits_close(logits[:, row], ref)
    cfg = model.config
    for fraction in (0.25,):
        slots = max(1, math.floor(fraction * cfg.num_layers * cfg.num_experts))
        got_tokens, got_logits, stats = _engine_rows(root / "strata", resident_experts=slots,
                                                     predictor="next-gate")
        np.testing.assert_array_equal(got_tokens, tokens, err_msg=f"{fraction}")
        np.testing.assert_array_equal(got_logits, logits, err_msg=f"{fraction}")
        assert stats["misses_per_step"] > 0
