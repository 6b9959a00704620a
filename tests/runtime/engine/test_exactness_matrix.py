"""Every predictor x policy x dequant setting, at budgets holding 10 %, 35 % (the synthetic
models), 70 % and 100 % of the experts, gives greedy tokens and every step's logits
bit-identical to an unlimited budget, on a tiny synthetic model trained on the Markov
language (`synth_train`) and its int8-dense + int4-GPTQ-expert quantization, and on a tiny
HF-converted model and its int8 + int4 (round-to-nearest) quantization; and the same tokens
as the resident API. With
batch_capacity=2 a staging half holds 4 of 8 experts, so prefill runs in several passes.
Host dequantization runs on the synthetic int4 model only, at the 35 % budget: where int4
experts are unpacked depends on neither the family nor the budget.
"""

import itertools
import warnings

import numpy as np
import pytest

import strata_jax
from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.step.programs import PREDICTORS
from strata_jax.tools.quantize import CalibrationWarning, quantize_checkpoint
from strata_jax.tools.synth_train import train_synthetic
from strata_runtime.cli.main import main as cli_main
from strata_runtime.engine.config import DEQUANT, EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.residency.cache_policy import POLICIES
from tests.helpers import tiny_config, write_checkpoint
from tests.runtime.contract import run_rows

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 1]]
NEW_TOKENS = 4
FRACTIONS = (0.1, 0.35, 0.7)  # and 1.0: resident_experts=None, the reference itself
SHORT_FRACTIONS = (0.1, 0.7)  # the HF models': each budget is a compile (test time)


def _hf_mixtral(path):
    from tests.tools.test_hf_convert import build_model

    src = path.parent / "hf_src"
    build_model("mixtral", hidden_size=128, intermediate_size=128).save_pretrained(src)
    assert cli_main(["convert", "hf", str(src), str(path)]) == 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    write_checkpoint(tiny_config("qwen3_moe", num_experts=8, hidden_size=128, head_dim=32,
                                 expert_intermediate_size=128), root / "synthetic", seed=11)
    # trained on the Markov language, so its routing and logits are a model's, not noise's
    assert train_synthetic(root / "synthetic", 30, progress=False)["steps"] == 30
    _hf_mixtral(root / "hf")
    with warnings.catch_warnings():  # experts with few calibration tokens are rounded
        warnings.simplefilter("ignore", CalibrationWarning)
        quantize_checkpoint(root / "synthetic", root / "synthetic-int4", experts="int4-gptq",
                            dense="int8", min_tokens=32, progress=False)
    quantize_checkpoint(root / "hf", root / "hf-int4", experts="int4-rtn", dense="int8",
                        progress=False)
    return root


def _fractions(model: str, dequant: str) -> tuple[float, ...]:
    """The budgets a setting runs at (each a compile): the synthetic models' three on the
    device path; host dequantization unpacks experts as they enter tier 1, whatever the
    budget, so one budget; the HF models' two."""
    if dequant == "host":
        return (0.35,)
    return FRACTIONS if model.startswith("synthetic") else SHORT_FRACTIONS


def _generate(reader, **knobs):
    """Tier 1 holds every expert here; the disk tier's resume:
    tests/runtime/engine/test_engine.py."""
    with Engine(reader, EngineConfig(batch_capacity=2, max_len=32, **knobs)) as engine:
        tokens, logits = run_rows(engine, PROMPTS, NEW_TOKENS)
        return tokens, logits, engine


@pytest.mark.parametrize("model", ["synthetic", "hf", "synthetic-int4", "hf-int4"])
def test_every_setting_is_bit_identical_to_unlimited(checkpoints, model):
    reader = CheckpointReader(checkpoints / model)
    cfg = reader.config
    total = cfg.num_layers * cfg.num_experts
    dequants = DEQUANT if model == "synthetic-int4" else ("device",)
    resident_api = strata_jax.generate(strata_jax.load(checkpoints / model), PROMPTS,
                                       NEW_TOKENS, batch_capacity=2, max_len=32)
    for dequant in dequants:
        ref_tokens, ref_logits, full = _generate(reader, dequant=dequant)
        assert full.layout.resident and full.layout.staging == 0
        if dequant == "device":
            assert ref_tokens.tolist() == resident_api
        for predictor, policy in itertools.product(PREDICTORS, POLICIES):
            for fraction in _fractions(model, dequant):
                tokens, logits, engine = _generate(
                    reader, dequant=dequant, predictor=predictor, policy=policy,
                    resident_experts=int(fraction * total))
                where = f"{model} {dequant} {predictor} {policy} {fraction:.0%}"
                np.testing.assert_array_equal(tokens, ref_tokens, err_msg=where)
                np.testing.assert_array_equal(logits, ref_logits, err_msg=where)
                assert engine.stats()["misses_per_step"] > 0, where


def test_batched_generation_equals_per_request(checkpoints):
    reader = CheckpointReader(checkpoints / "synthetic")
    batched, batched_logits, _ = _generate(reader, resident_experts=3)
    for i, prompt in enumerate(PROMPTS):
        with Engine(reader, EngineConfig(batch_capacity=2, max_len=32,
                                         resident_experts=3)) as engine:
            alone, logits = run_rows(engine, [prompt], NEW_TOKENS)
        np.testing.assert_array_equal(alone[0], batched[i])
        np.testing.assert_array_equal(logits[:, 0], batched_logits[:, i])
