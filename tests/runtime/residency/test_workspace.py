"""The ledger's workspace line is the scratch of the compiled step programs, and a small model
offloads below its resident budget with the default knobs."""

import jax
import numpy as np

import strata_jax
from strata_jax.formats.checkpoint import CheckpointReader
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.engine.plan import plan_for
from tests.helpers import tiny_config, write_checkpoint

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]


def _temp(program, *args) -> int:
    return program.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_workspace_is_the_compiled_programs_scratch_and_a_tight_budget_offloads(tmp_path):
    path = tmp_path / "ck"
    write_checkpoint(tiny_config("qwen3_moe"), path, seed=3)
    reader = CheckpointReader(path)
    shape = {"batch_capacity": 4, "max_len": 32}
    resident = plan_for(reader, EngineConfig(hbm_budget="1GiB", **shape))
    assert resident.resident and 0 < resident.workspace < 256 * 2**20
    budget = resident.resident_budget - 2 * resident.bytes_per_expert  # no longer fits whole
    config = EngineConfig(hbm_budget=budget, **shape)
    ledger = plan_for(reader, config)
    assert not ledger.resident and 0 < ledger.pool_slots < ledger.num_experts
    with Engine(reader, config) as engine:
        assert engine.layout.ledger == ledger
        args = (engine.cfg, engine.plan, engine.params, engine.residency.pool,
                engine.residency.tiers(), engine.state)
        real = _temp(engine._decode, *args)  # the program the engine runs, at its real pool
        assert real <= ledger.workspace
        out = engine.generate(PROMPTS, 6)
    assert out == strata_jax.generate(strata_jax.load(path), PROMPTS, 6, **shape)
    fixed = plan_for(reader, EngineConfig(hbm_budget="1GiB", workspace="3MiB", **shape))
    assert fixed.workspace == 3 * 2**20
    jax.clear_caches()
    np.testing.assert_equal(plan_for(reader, config).workspace, ledger.workspace)
