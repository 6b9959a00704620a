"""GPT-OSS through `strata convert hf`: tiny random `GptOssForCausalLM`s made with transformers
and saved with `save_pretrained` (sliding windows shorter and longer than the prompts, sinks,
q/k/v/o biases or none, YaRN or plain RoPE, a clamp that bites) convert and reproduce
transformers' logits and greedy tokens, prefilled whole or in chunks shorter than the window;
offloaded, the engine gives the resident bits."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import strata_jax  # noqa: E402
from strata_jax.tools.hf_convert import convert_hf, model_config_from_hf  # noqa: E402
from strata_runtime.cli import main as cli  # noqa: E402
from tests.tools.test_hf_convert import (  # noqa: E402
    assert_logits_close,
    hf_greedy,
    hf_logits,
    logit_margin,
)

BASE = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=64, eos_token_id=None, pad_token_id=0, bos_token_id=None)
YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
            truncate=False, original_max_position_embeddings=16)
SHAPES = {
    # the window shorter than every prompt, sliding and full layers alternating, YaRN
    "window-4": dict(num_hidden_layers=3, sliding_window=4, rope_parameters=YARN),
    # the window longer than the prompts; no q/k/v/o biases; a clamp that bites; plain RoPE
    "window-32": dict(num_hidden_layers=2, sliding_window=32, attention_bias=False,
                      swiglu_limit=1.0, num_experts_per_tok=3,
                      rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # every layer sliding, a window of 3, one kv head
    "all-sliding": dict(num_hidden_layers=2, sliding_window=3, num_key_value_heads=1,
                        layer_types=["sliding_attention"] * 2, rope_parameters=YARN),
}
PROMPTS = np.random.default_rng(5).integers(0, 128, size=(2, 14)).tolist()
GEN_PROMPTS = [PROMPTS[0][:9], PROMPTS[1]]
NEW = 10
ROUTING_MARGIN = 1e-4


def build(shape: str, seed: int = 0, **overrides):
    """A tiny float32 GPT-OSS with every weight random (biases and sinks too: never zero),
    redrawn until no token of PROMPTS routes within ROUTING_MARGIN of a tie."""
    cfg = transformers.GptOssConfig(**{**BASE, **SHAPES[shape], **overrides})
    for draw in range(seed, seed + 50):
        torch.manual_seed(draw)
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=torch.float32, experts_implementation="eager")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif name.endswith("sinks"):
                    p.copy_(torch.randn_like(p))
                else:
                    p.copy_(0.15 * torch.randn_like(p))
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        if routing_margin(model.eval()) >= ROUTING_MARGIN:
            return model
    raise AssertionError(f"{shape}: 50 draws all route PROMPTS within a tie")


def routing_margin(model) -> float:
    """Smallest gap between the k-th and (k+1)-th router logit over PROMPTS' tokens."""
    return logit_margin(model, PROMPTS, "mlp.router")


@pytest.fixture(scope="module", params=sorted(SHAPES))
def case(request, tmp_path_factory):
    shape = request.param
    root = tmp_path_factory.mktemp(shape)
    hf = build(shape)
    hf.save_pretrained(root / "hf")
    assert cli.main(["convert", "hf", str(root / "hf"), str(root / "strata")]) == 0
    return shape, hf, strata_jax.load(root / "strata"), root


def test_config_maps_every_switch(case):
    shape, hf, model, _ = case
    cfg, src = model.config, hf.config
    sliding = tuple(i for i, t in enumerate(src.layer_types) if t == "sliding_attention")
    assert (cfg.family, cfg.scoring, cfg.sliding_window, cfg.sliding_layers) == (
        "gpt_oss", "topk_softmax", src.sliding_window, sliding)
    assert cfg.attention_sinks and cfg.expert_bias and cfg.router_bias
    assert cfg.attention_bias == cfg.o_bias == src.attention_bias
    assert cfg.swiglu_limit == src.swiglu_limit and cfg.swiglu_alpha == src.swiglu_alpha
    assert (cfg.rope_scaling is not None) == (src.rope_parameters["rope_type"] == "yarn")


def test_logits_match_transformers(case):
    _, hf, model, _ = case
    assert_logits_close(strata_jax.logits(model, PROMPTS), hf_logits(hf, PROMPTS))


@pytest.mark.parametrize("chunk", [None, 8])
def test_greedy_tokens_match_transformers(case, chunk):
    """Whole prompts, or prefilled in chunks of 8 (the 14-token prompt in two; longer than
    the windows of 3 and 4): the window masks the cache across chunks, within one, and in
    the decode steps alike."""
    _, hf, model, _ = case
    ref = [hf_greedy(hf, p, NEW) for p in GEN_PROMPTS]
    got = strata_jax.generate(model, GEN_PROMPTS, NEW, batch_capacity=2, max_len=32,
                              prefill_chunk=chunk)
    assert got == ref


def test_mxfp4_experts_and_unknown_layer_types_are_refused_by_name(case):
    shape, hf, _, root = case
    if shape != "window-4":
        pytest.skip("one shape is enough")
    src = hf.config.to_dict()
    with pytest.raises(ValueError, match="layer_types"):
        model_config_from_hf({**src, "layer_types": ["chunked_attention"] * 3})
    from safetensors.numpy import load_file, save_file

    bad = root / "mxfp4"
    hf.save_pretrained(bad)
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[f"{name}_blocks"] = tensors.pop(name)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name}_blocks.*MXFP4"):
        convert_hf(bad, root / "mxfp4.strata")
    assert not (root / "mxfp4.strata").exists()


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
    """The engine prefills in chunks of 8 and decodes past the window: every decode step's
    logits are transformers' over the whole sequence, and with a tenth or half of the
    experts in HBM (the rest copied in from the host tier) the same bits."""
    shape, hf, model, root = case
    if shape != "window-4":
        pytest.skip("one shape is enough")
    tokens, logits, _ = _engine_rows(root / "strata")
    for row, prompt in enumerate(GEN_PROMPTS):
        seq = prompt + tokens[row].tolist()
        ref = hf_logits(hf, [seq])[0, len(prompt):len(seq) - 1]
        assert_logits_close(logits[:, row], ref)
    cfg = model.config
    for fraction in (0.1, 0.5):
        slots = max(1, int(fraction * cfg.num_layers * cfg.num_experts))
        got_tokens, got_logits, stats = _engine_rows(root / "strata", resident_experts=slots,
                                                     predictor="next-gate")
        np.testing.assert_array_equal(got_tokens, tokens, err_msg=f"{fraction}")
        np.testing.assert_array_equal(got_logits, logits, err_msg=f"{fraction}")
        assert stats["misses_per_step"] > 0
