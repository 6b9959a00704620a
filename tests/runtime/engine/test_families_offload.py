"""The offload engine on the 2026 families: HF-converted tiny DeepSeek-V3 (MLA, a dense first
layer, grouped sigmoid routing, shared experts), GLM-4.5 (int8 dense + int4 experts) and
Qwen3-Next (Gated DeltaNet layers with their conv and recurrent states) give
at 10 % and 50 % of their experts in HBM every step's logits and the greedy tokens bit for
bit as with every expert resident, and the resident API's tokens."""

import numpy as np
import pytest

import strata_jax
from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.tools.quantize import quantize_checkpoint
from strata_runtime.cli.main import main as cli_main
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from tests.runtime.contract import run_rows

pytest.importorskip("transformers")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 1]]
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.tools.test_hf_families import build

    root = tmp_path_factory.mktemp("families")
    int4_dims = dict(hidden_size=128, moe_intermediate_size=128)  # the int4 group
    for shape, dims in (("deepseek_v3-qlora", {}), ("glm4_moe", int4_dims)):
        build(shape, **dims).save_pretrained(root / f"{shape}-hf")
        assert cli_main(["convert", "hf", str(root / f"{shape}-hf"), str(root / shape)]) == 0
    quantize_checkpoint(root / "glm4_moe", root / "glm4_moe-int4", experts="int4-rtn",
                        dense="int8", progress=False)
    from tests.tools.test_hf_qwen3_next import build as build_qwen3_next

    build_qwen3_next("interval-2").save_pretrained(root / "qwen3_next-hf")
    assert cli_main(["convert", "hf", str(root / "qwen3_next-hf"), str(root / "qwen3_next")]) == 0
    return root


def _generate(reader, **knobs):
    with Engine(reader, EngineConfig(batch_capacity=2, max_len=32, **knobs)) as engine:
        tokens, logits = run_rows(engine, PROMPTS, NEW_TOKENS)
        return tokens, logits, engine.stats()


@pytest.mark.parametrize("model", ["deepseek_v3-qlora", "glm4_moe-int4", "qwen3_next"])
def test_offloaded_budgets_are_bit_identical_to_resident(checkpoints, model):
    reader = CheckpointReader(checkpoints / model)
    cfg = reader.config
    ref_tokens, ref_logits, _ = _generate(reader)
    resident_api = strata_jax.generate(strata_jax.load(checkpoints / model), PROMPTS,
                                       NEW_TOKENS, batch_capacity=2, max_len=32)
    assert ref_tokens.tolist() == resident_api
    for fraction in (0.1, 0.5):
        slots = max(1, int(fraction * cfg.num_layers * cfg.num_experts))
        tokens, logits, stats = _generate(reader, resident_experts=slots,
                                          predictor="next-gate")
        np.testing.assert_array_equal(tokens, ref_tokens, err_msg=f"{model} {fraction}")
        np.testing.assert_array_equal(logits, ref_logits, err_msg=f"{model} {fraction}")
        assert stats["misses_per_step"] > 0


def test_linear_layers_keep_their_state_across_disk_stalls(checkpoints):
    """Experts read from disk as the steps find them: each stall runs the step again from the
    stalled layer, and a Gated DeltaNet layer's state update (not idempotent) is applied once,
    so every step's logits are the resident run's, bit for bit."""
    reader = CheckpointReader(checkpoints / "qwen3_next")
    ref_tokens, ref_logits, _ = _generate(reader)
    tokens, logits, stats = _generate(reader, resident_experts=2, host_experts=0)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_array_equal(logits, ref_logits)
    assert stats["by_phase"]["decode"]["totals"]["disk_loads"] > 0
