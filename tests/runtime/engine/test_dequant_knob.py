"""Quantized experts: both dequant settings are bit-identical across budgets."""

import numpy as np
import pytest

from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.ops.int4_kernel import Int4Tiles
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.engine.plan import plan_for
from strata_runtime.residency.ledger import ModelBytes
from tests.helpers import write_quantized_checkpoint
from tests.runtime.contract import run_rows

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    # not square: host-dequantized matrices arrive transposed, and a missed transpose must fail
    return write_quantized_checkpoint(tmp_path_factory.mktemp("dequant"),
                                      expert_intermediate_size=256, num_experts=4)


def _generate(checkpoint, resident_experts=3, **knobs):
    """An engine on the checkpoint with 1 host expert, and its tokens and per-step logits."""
    engine = Engine.from_checkpoint(checkpoint, EngineConfig(
        resident_experts=resident_experts, host_experts=1, batch_capacity=2, max_len=24,
        **knobs))
    with engine:
        return run_rows(engine, PROMPTS, 5), engine


@pytest.fixture(scope="module")
def host_dequantized(quantized):
    """The run with experts dequantized on the host (three tests read it)."""
    return _generate(quantized, dequant="host")


@pytest.fixture(scope="module")
def device_dequantized(quantized):
    """The same run with the packed experts dequantized in the kernel (three tests read it)."""
    return _generate(quantized, dequant="device")


def test_host_and_device_dequant_agree(host_dequantized, device_dequantized):
    """(Each setting's bit-identity across budgets: test_exactness_matrix.py.)"""
    (dev_tokens, dev_logits), dev = device_dequantized
    (host_tokens, host_logits), host = host_dequantized
    assert dev.residency.pool.w1.dtype.name == "uint8"
    assert host.residency.pool.w1.dtype.name == "bfloat16"
    np.testing.assert_array_equal(host_tokens, dev_tokens)
    # the same bf16(q * s) weights, multiplied by different code paths
    np.testing.assert_allclose(host_logits, dev_logits, rtol=0,
                               atol=0.02 * np.abs(dev_logits).max())


def test_int4_kernel_tiles_are_a_knob_and_must_tile_the_experts(quantized, device_dequantized):
    tiles = Int4Tiles(64, stages=2, groups=1, down_splits=2)  # D = 128, F = 256 tile by it
    np.testing.assert_array_equal(_generate(quantized, int4_tiles=tiles)[0][0],
                                  device_dequantized[0][0])
    with pytest.raises(ValueError, match=r"int4_tiles=.*hidden 128, intermediate 256"):
        _generate(quantized, int4_tiles=Int4Tiles(64, stages=2, groups=2))  # 256 per step


def test_tile_major_slots_are_exact_across_budgets(quantized):
    """weight_layout="tiles": both tiers hold the packed bytes tile-major; the outputs do not
    change by a bit from the resident rows layout. Offloaded, so the pinned slots, tier 1 and
    the copies between them all hold tiles (a resident tiles engine has only the first)."""
    (ref_tokens, ref_logits), rows = _generate(quantized, None, weight_layout="rows")
    assert rows.residency.pool.w1.ndim == 3 and rows.layout.resident
    (tokens, logits), engine = _generate(quantized, 3, weight_layout="tiles")
    assert engine.residency.pool.tile == (64, 128)  # D = 128: one group of inputs a step
    assert not engine.layout.resident and engine.shares[0].residency.host.tile == (64, 128)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_array_equal(logits, ref_logits)


def test_weight_layout_is_checked(quantized, host_dequantized):
    with pytest.raises(ValueError, match="weight_layout must be one of"):
        _generate(quantized, weight_layout="columns")
    with pytest.raises(ValueError, match="dequantized on the device"):
        _generate(quantized, weight_layout="tiles", dequant="host")
    (tokens, _), engine = host_dequantized  # weight_layout "auto"
    assert engine.residency.pool.w1.ndim == 3 and tokens.size


def test_unknown_dequant_is_refused():
    with pytest.raises(ValueError, match="dequant must be one of"):
        EngineConfig(dequant="gpu")


def test_host_dequant_ledger_sizes_slots_as_bf16(quantized):
    """Slots of a host-dequantizing engine hold bf16 experts: a budget that holds every packed
    expert is then too small to be resident, and tier 1 holds bf16 experts as well."""
    reader = CheckpointReader(quantized)
    bf16 = 3 * 128 * 256 * 2
    packed = ModelBytes.from_reader(reader).bytes_per_expert
    device = plan_for(reader, EngineConfig(hbm_budget="1GiB", dequant="device",
                                           workspace=0, max_len=24, batch_capacity=2))
    # every packed expert, or 2 staging + 2 pool slots of bf16 experts; + the 5 % workspace
    budget = device.dense + device.kv_cache + max(device.num_experts * packed, 4 * bf16)
    budget += budget // 10
    knobs = dict(hbm_budget=budget, host_budget=packed * 5, workspace=0, max_len=24,
                 batch_capacity=2, staging_slots=1)
    assert plan_for(reader, EngineConfig(dequant="device", **knobs)).resident
    host = plan_for(reader, EngineConfig(dequant="host", **knobs))
    assert host.bytes_per_expert == bf16 > packed and not host.resident
    assert host.host_slots == packed * 5 // bf16  # tier 1 holds them dequantized too
    with Engine(reader, EngineConfig(dequant="host", **knobs)) as engine:
        pool = engine.residency.pool
        held = sum(a.nbytes for a in (pool.w1, pool.w3, pool.w2))
        assert held == pool.num_slots * bf16 and pool.w1_scale is None
        assert engine.layout.staging > 0


def test_host_compute_takes_packed_and_host_dequantized_experts(quantized, host_dequantized,
                                                               device_dequantized):
    """miss='host' reads tier 1 as it is held: bf16 (dequant='host'), or packed int4 (the host
    kernel dequantizes in registers)."""
    (ref_tokens, ref_logits), _ = host_dequantized
    (tokens, logits), engine = _generate(quantized, dequant="host", miss="host")
    assert engine.counters.hosted > 0
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=0.02 * np.abs(ref_logits).max())
    (dev_tokens, dev_logits), _ = device_dequantized
    (tokens, logits), engine = _generate(quantized, miss="host")
    assert engine.counters.hosted > 0 and engine.shares[0].residency.host.quantized
    np.testing.assert_array_equal(tokens, dev_tokens)
    np.testing.assert_allclose(logits, dev_logits, rtol=0, atol=0.02 * np.abs(dev_logits).max())


def test_biased_experts_keep_their_biases_dequantized_on_the_host(tmp_path):
    """GPT-OSS's experts carry biases (never quantized): dequantized on the host they arrive
    with them, and the offloaded tokens are the resident API's."""
    import strata_jax
    from strata_jax.tools.quantize import quantize_checkpoint
    from tests.helpers import tiny_config, write_checkpoint

    cfg = tiny_config("gpt_oss", hidden_size=128, expert_intermediate_size=128, head_dim=32,
                      shared_intermediate_size=128, dense_intermediate_size=128)
    write_checkpoint(cfg, tmp_path / "float", seed=1)
    quantize_checkpoint(tmp_path / "float", tmp_path / "int4", experts="int4-rtn",
                        dense="none", progress=False)
    want = strata_jax.generate(strata_jax.load(tmp_path / "int4"), PROMPTS, 5,
                               batch_capacity=2, max_len=24)
    with Engine.from_checkpoint(tmp_path / "int4", EngineConfig(
            resident_experts=1, batch_capacity=2, max_len=24, dequant="host")) as engine:
        assert engine.shares[0].residency.host.biased
        assert engine.generate(PROMPTS, 5) == want
