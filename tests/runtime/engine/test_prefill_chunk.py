"""Long prefill chunks: a prompt runs in ceil(len / chunk) programs, each routed expert is
copied once per layer per chunk, the tokens are the resident API's at every chunk length, and
the ledger picks the longest default chunk whose workspace fits the budget; running rows ride
along a prompt's programs and keep their tokens."""

import math

import pytest

import strata_jax
from strata_jax.batching.scheduler import Scheduler
from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.step import programs as step
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.engine.plan import plan_for
from tests.helpers import tiny_config, write_checkpoint

SHAPE = {"batch_capacity": 2, "max_len": 160}
PROMPTS = [[(7 * i + 3) % 97 for i in range(130)], [(5 * i + 1) % 97 for i in range(41)]]
NEW = 12  # every test's tokens: the riding rows decode through the 5 programs of a prompt
KEEP_PROGRAMS = True  # engines of one layout share their programs (tests/runtime/conftest.py)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("chunk") / "ck"
    write_checkpoint(tiny_config("qwen3_moe", num_experts=8), path, seed=11)
    return path


@pytest.fixture(scope="module")
def resident(ckpt):
    """The resident API's tokens at its default chunk (the whole prompt in one program)."""
    return strata_jax.generate(strata_jax.load(ckpt), PROMPTS, NEW, **SHAPE)


# 6 of 16 experts in HBM slots. No hbm_budget: with an explicit chunk and resident_experts the
# layout is the same, and a budget only adds the ledger's abstract compiles of every chunk's
# programs (the ledger's choice of chunk: test_the_ledger_halves_..., its workspace:
# tests/runtime/residency/test_workspace.py)
OFFLOADED = {"resident_experts": 6}


@pytest.mark.parametrize("chunk", [8, 32, 256])
def test_offloaded_prefill_in_chunks_gives_the_resident_tokens(ckpt, resident, chunk):
    reader = CheckpointReader(ckpt)
    config = EngineConfig(prefill_chunk=chunk, **OFFLOADED, **SHAPE)
    with Engine(reader, config) as engine:
        assert engine.plan.staging > 0 and engine.prefill_chunk == chunk
        assert engine.generate(PROMPTS, NEW) == resident
        prefill = engine.stats()["by_phase"]["prefill"]
    assert prefill["calls"] == sum(math.ceil(len(p) / chunk) for p in PROMPTS)


def test_a_longer_chunk_copies_fewer_experts_per_prompt_token(ckpt):
    reader = CheckpointReader(ckpt)
    fetched = {}
    for chunk in (8, 128):
        config = EngineConfig(prefill_chunk=chunk, predictor="none", **OFFLOADED, **SHAPE)
        with Engine(reader, config) as engine:
            engine.generate(PROMPTS[:1], 1)
            fetched[chunk] = engine.stats()["by_phase"]["prefill"]["totals"]["fetched"]
    # 130 tokens route to every expert of a layer: chunks of 8 copy each miss up to 17 times
    assert 0 < fetched[128] * 4 < fetched[8]


def test_the_ledger_halves_the_default_chunk_until_its_workspace_fits(ckpt):
    reader = CheckpointReader(ckpt)
    assert step.default_prefill_chunk(SHAPE["max_len"]) == 256
    roomy = plan_for(reader, EngineConfig(hbm_budget="1GiB", **SHAPE))
    assert roomy.prefill_chunk == 256
    small = plan_for(reader, EngineConfig(hbm_budget="1GiB", prefill_chunk=64, **SHAPE))
    assert small.workspace < roomy.workspace
    # room for the 64-token chunk's workspace and one expert slot, not for the 256-token one's
    need = small.dense + small.kv_cache + small.workspace + small.bytes_per_expert
    tight = need + 2 * small.bytes_per_expert * max(small.staging_slots, 1)
    if tight >= roomy.dense + roomy.kv_cache + roomy.workspace:
        pytest.skip("the chunk's workspace is too small a share of this model to squeeze")
    ledger = plan_for(reader, EngineConfig(hbm_budget=tight, **SHAPE))
    assert step.MIN_PREFILL_CHUNK <= ledger.prefill_chunk < 256
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(prefill_chunk=48)


@pytest.mark.parametrize("knobs", [OFFLOADED, {**OFFLOADED, "host_experts": 0}],
                         ids=["tier1", "disk"])
def test_a_running_row_rides_along_a_long_prompts_chunks(ckpt, resident, knobs):
    """A row decodes inside each of a 130-token prompt's 5 prefill programs (copies and disk
    stalls included): both requests keep the resident API's tokens."""
    config = EngineConfig(prefill_chunk=32, **knobs, **SHAPE)
    with Engine(CheckpointReader(ckpt), config) as engine:
        sched = Scheduler(engine)
        running = sched.submit(PROMPTS[1], NEW)
        sched.step()
        sched.step()
        joining = sched.submit(PROMPTS[0], NEW)
        sched.run()
        stats = engine.stats()
    assert [joining.tokens, running.tokens] == resident
    assert stats["ridden_tokens"] == 5  # one per program of the joining prompt
    if "host_experts" in knobs:
        assert stats["by_phase"]["prefill"]["totals"]["disk_loads"] > 0
