"""Offloaded generation is bit-identical to an unlimited budget."""

import numpy as np
import pytest
from strata_runtime.engine import Engine, EngineConfig

import strata_jax
from tests.helpers import tiny_config
from tests.test_checkpoint import _write

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "ck"
    _write(tiny_config("qwen2_moe"), path, seed=5)
    return path


def _run(ckpt, resident, host=None):
    engine = Engine.from_checkpoint(ckpt, EngineConfig(resident_experts=resident,
                                                       host_experts=host, batch_capacity=4,
                                                       max_len=32))
    tokens, logits = engine.generate_with_logits(PROMPTS, 6)
    return tokens, logits, engine


def test_budgets_are_bit_identical_to_unlimited(ckpt):
    ref_tokens, ref_logits, full = _run(ckpt, None)
    assert full.staged == 0
    total = full.cfg.num_layers * full.cfg.num_experts
    for fraction in (0.1, 0.35, 0.7):
        tokens, logits, engine = _run(ckpt, int(fraction * total), host=2)
        assert tokens == ref_tokens
        np.testing.assert_array_equal(logits, ref_logits)
        assert engine.staged > 0
        assert engine.store.stats.hits[2] > 0 and engine.store.stats.hits[1] > 0


def test_engine_matches_resident_generate(ckpt):
    tokens, _, _ = _run(ckpt, 3)
    assert tokens == strata_jax.generate(strata_jax.load(ckpt), PROMPTS, 6)


def test_budget_goes_through_the_ledger(ckpt):
    from strata_runtime.ledger import BudgetError

    with pytest.raises(BudgetError, match="too small"):
        Engine.from_checkpoint(ckpt, EngineConfig(hbm_budget="1MiB", max_len=32))
    engine = Engine.from_checkpoint(ckpt, EngineConfig(hbm_budget="1GiB", host_budget="1MiB",
                                                       batch_capacity=4, max_len=32))
    assert engine.ledger.resident and engine.pool.permanent == 12
