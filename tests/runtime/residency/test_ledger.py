"""The HBM ledger: sizes by hand, budget errors, tier splits, and a budget property."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.formats.config import ModelConfig
from strata_jax.tools.synth import synth_config
from strata_runtime.residency.ledger import (
    BudgetError,
    ModelBytes,
    default_max_len,
    default_staging_slots,
    parse_bytes,
    plan_ledger,
    resident_budget,
)
from tests.helpers import write_checkpoint

INT4 = {"dense": "int8", "experts": "int4-g128"}


def tiny(**changes) -> ModelConfig:
    base = dict(
        family="mixtral", vocab_size=100, hidden_size=16, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=4, num_experts=8, top_k=2, expert_intermediate_size=8,
    )  # fmt: skip
    return ModelConfig(**{**base, **changes})


def test_model_bytes_float32_by_hand():
    mb = ModelBytes.from_config(tiny())
    d, v, q, kv, f, e = 16, 100, 4 * 4, 2 * 4, 8, 8
    assert mb.global_bytes == 4 * (2 * v * d + d)  # embed + lm_head + final_norm
    attn = d * q + 2 * d * kv + q * d
    assert mb.dense_per_layer == 4 * (attn + 2 * d + d * e)  # + two norms + router
    assert mb.bytes_per_expert == 4 * 3 * d * f
    assert mb.kv_bytes_per_token == 2 * 2 * kv * 4  # K and V, 2 layers, float32
    assert (mb.num_experts, mb.expert_bytes) == (2 * e, 2 * e * 4 * 3 * d * f)
    assert mb.dense == mb.global_bytes + 2 * mb.dense_per_layer
    counts = tiny().param_counts()
    assert (mb.dense, mb.expert_bytes) == (4 * counts["dense"], 4 * counts["routed"])


def test_model_bytes_quantized_bf16_tied_shared_by_hand():
    cfg = tiny(
        family="qwen2_moe", hidden_size=128, expert_intermediate_size=256, num_heads=2,
        num_kv_heads=1, head_dim=64, shared_intermediate_size=128, shared_gate=True,
        tie_word_embeddings=True, dtype="bfloat16",
    )  # fmt: skip
    mb = ModelBytes.from_config(cfg, INT4)
    d, v, q, kv, f, fs, e = 128, 100, 128, 64, 256, 128, 8

    def int4(k, n):  # packed nibbles + one bf16 scale per 128 input rows and column
        return k * n // 2 + (k // 128) * n * 2

    def int8(k, n):  # int8 values + one bf16 scale per column
        return k * n + 2 * n

    assert mb.global_bytes == 2 * (v * d + d)  # tied: no lm_head
    attn = int8(d, q) + 2 * int8(d, kv) + int8(q, d)
    shared = 2 * int8(d, fs) + int8(fs, d)  # shared w1, w3 are [d, fs]; w2 is [fs, d]
    assert mb.dense_per_layer == attn + shared + 2 * (2 * d + d * e + d)  # norms, router, gate
    assert mb.bytes_per_expert == 2 * int4(d, f) + int4(f, d)
    assert mb.kv_bytes_per_token == 2 * 2 * kv * 2


def test_model_bytes_from_reader_matches_the_checkpoint(tmp_path):
    cfg = tiny()
    _, _, experts = write_checkpoint(cfg, tmp_path / "ck")
    reader = CheckpointReader(tmp_path / "ck")
    mb = ModelBytes.from_reader(reader)
    assert mb == ModelBytes.from_config(cfg)
    assert mb.bytes_per_expert == sum(reader.read_expert(1, 3, k).nbytes for k in experts)
    assert mb.global_bytes == sum(a.nbytes for a in reader.read_globals().values())
    assert mb.dense_per_layer == sum(a.nbytes for a in reader.read_layer_dense(0).values())


def _plan(mb, hbm, host=None, **kw):
    kw = {"batch_capacity": 1, "max_len": 10, "workspace_fraction": 0.0,
          "workspace_floor": 1000, **kw}  # fmt: skip
    return plan_ledger(mb, hbm, host, **kw)


def test_partial_pool_by_hand():
    mb = ModelBytes.from_config(tiny())
    bpe, dense = 4 * 3 * 16 * 8, mb.dense
    kv = 1 * 10 * mb.kv_bytes_per_token
    staging = 2 * 2 * bpe  # batch 1 x top_k 2 = 2 experts per layer step, double-buffered
    hbm = dense + kv + staging + 1000 + 5 * bpe + 17
    led = _plan(mb, hbm)
    assert (led.dense, led.kv_cache, led.staging, led.workspace) == (dense, kv, staging, 1000)
    assert (led.staging_slots, led.pool_slots, led.pool, led.free) == (2, 5, 5 * bpe, 17)
    assert (led.tier0, led.tier1, led.tier2) == (5, 11, 0)  # unlimited host
    assert led.used + led.free == hbm and not led.resident


def test_over_devices_the_hbm_budget_is_each_devices_and_the_host_budget_all_of_theirs():
    """16 experts (8 a layer) over 3 devices: they own 6, 6 and 4; every HBM line is per
    device, tier 1 is the host budget's even split in whole experts."""
    mb = ModelBytes.from_config(tiny())
    bpe, fixed = mb.bytes_per_expert, mb.dense + 10 * mb.kv_bytes_per_token + 1000
    led = _plan(mb, fixed + (2 * 1 + 3) * bpe + 17, 3 * 2 * bpe + 2, devices=3,
                staging_slots=1)
    assert led.owned == (6, 6, 4) and led.devices == 3
    assert (led.staging_slots, led.pool_slots, led.free) == (1, 3, 17)
    assert (led.dense, led.workspace) == (mb.dense, 1000)  # each device's, whole
    assert led.host_share == 2 and led.host_slots == 6  # 2 experts (+ 2 bytes) per share
    assert led.device_tiers() == [(3, 2, 1), (3, 2, 1), (3, 1, 0)]
    assert (led.tier0, led.tier1, led.tier2) == (9, 5, 2)
    assert led.used + led.free == led.hbm_budget and not led.resident
    text = led.render()
    assert "per device; 3 devices:" in text and "owning 6, 6, 4" in text
    assert "3 / 3 / 3" in text and "2 / 2 / 1" in text and "1 / 1 / 0" in text
    # a device's layer needs at most ceil(8 / 3) = 3 experts
    assert [default_staging_slots(mb, b, 3) for b in (1, 16)] == [2, 3]
    # each device holds all its own experts in a budget one device could not hold them in
    resident = _plan(mb, fixed + 6 * bpe, "0B", devices=3)
    assert resident.resident and resident.staging_slots == 0 and resident.pool_slots == 6
    assert not _plan(mb, fixed + 6 * bpe + 4 * bpe, "0B").resident
    with pytest.raises(BudgetError, match="per device is too small"):
        _plan(mb, fixed, devices=3)
    with pytest.raises(ValueError, match="expert_devices must be in"):
        _plan(mb, "1GB", devices=9)


def test_staging_slots_default_is_capped_by_experts_per_layer():
    mb = ModelBytes.from_config(tiny(num_layers=4))
    bpe, fixed = mb.bytes_per_expert, mb.dense + 16 * 10 * mb.kv_bytes_per_token + 1000
    led = _plan(mb, fixed + (2 * 8 + 8) * bpe, batch_capacity=16)
    assert (led.staging_slots, led.pool_slots) == (8, 8)  # min(8 per layer, 16 x top_k 2)
    led = _plan(mb, fixed + (2 * 3 + 3) * bpe, batch_capacity=16, staging_slots=3)
    assert (led.staging_slots, led.pool_slots, led.tier1) == (3, 3, 29)


def test_unlimited_budget_is_fully_resident_without_staging():
    mb = ModelBytes.from_config(tiny())
    led = plan_ledger(mb, "1TiB", "0B")
    assert (led.tier0, led.tier1, led.tier2) == (16, 0, 0)
    assert led.resident and led.staging == 0 and led.pool_slots == 16
    assert led.workspace == int(0.05 * 2**40)
    assert "fully resident" in led.render()


def test_resident_budget_is_the_threshold():
    mb = ModelBytes.from_config(tiny(hidden_size=256, expert_intermediate_size=512))
    need = resident_budget(mb.dense + 64 * mb.kv_bytes_per_token + mb.expert_bytes)
    assert plan_ledger(mb, need, batch_capacity=1, max_len=64).resident
    below = plan_ledger(mb, need - 1, batch_capacity=1, max_len=64)
    assert not below.resident and below.resident_budget == need
    assert (below.staging_slots, below.pool_slots) == (2, 16 - 4 - 1)


def test_host_budget_splits_tier1_and_tier2():
    mb = ModelBytes.from_config(tiny())
    bpe = mb.bytes_per_expert
    hbm = mb.dense + 10 * mb.kv_bytes_per_token + 1000 + (4 + 6) * bpe
    led = _plan(mb, hbm, host=7 * bpe + bpe // 2)
    assert (led.pool_slots, led.host_slots) == (6, 7)
    assert (led.tier0, led.tier1, led.tier2) == (6, 7, 3)
    assert _plan(mb, hbm, host="0").tier2 == 10
    assert _plan(mb, hbm, host=10**12).host_slots == 16  # capped at all experts
    text = led.render()
    assert "tier 2  disk" in text and "37.5%" in text  # 6 of 16 experts in HBM


def test_budget_too_small_names_the_ledger_and_the_shortfall():
    mb = ModelBytes.from_config(tiny())
    bpe = mb.bytes_per_expert
    minimum = mb.dense + 10 * mb.kv_bytes_per_token + 1000 + (4 + 2) * bpe  # staging + 2 slots
    with pytest.raises(BudgetError) as err:
        _plan(mb, minimum - 100, staging_slots=2)
    assert isinstance(err.value, ValueError) and err.value.shortfall == 100
    msg = str(err.value)
    for part in ("too small", "short by 100 B", "expert pool (1 slots)", "KV cache", "tier 0"):
        assert part in msg
    assert err.value.ledger.pool_slots == 1
    assert _plan(mb, minimum).pool_slots == 2  # exactly the minimum fits
    # the default staging (2 here) halves until the pool fits: 1 staging slot, 3 pool slots
    fallback = _plan(mb, minimum - 100)
    assert (fallback.staging_slots, fallback.pool_slots) == (1, 3)
    with pytest.raises(BudgetError, match="OVER BUDGET"):
        _plan(mb, 5000)  # not even the dense weights fit
    assert _plan(mb, minimum - 2 * bpe, min_pool_slots=0).pool_slots == 0


def test_bad_arguments():
    mb = ModelBytes.from_config(tiny())
    with pytest.raises(ValueError, match="batch_capacity"):
        plan_ledger(mb, "1GB", batch_capacity=0)
    with pytest.raises(ValueError, match="fraction"):
        plan_ledger(mb, "1GB", workspace_fraction=1.0)
    with pytest.raises(ValueError, match="staging_slots"):
        plan_ledger(mb, "1GB", staging_slots=0)
    with pytest.raises(ValueError, match="min_pool_slots"):
        plan_ledger(mb, "1GB", min_pool_slots=-1)
    with pytest.raises(ValueError, match="cannot parse"):
        plan_ledger(mb, "lots")


@pytest.mark.parametrize(
    "text, n",
    [
        ("24GB", 24 * 10**9),
        ("24GiB", 24 * 2**30),
        ("512MiB", 512 * 2**20),
        ("512 mib", 512 * 2**20),
        (" 1.5GiB ", 3 * 2**29),
        ("2kb", 2000),
        ("1TB", 10**12),
        ("7", 7),
        ("7B", 7),
        (".5KiB", 512),
        (123, 123),
        (0, 0),
        ("99999999999999999999GB", 99999999999999999999 * 10**9),  # exact, no float rounding
    ],
)
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["", "GB", "24G", "24 gigabytes", "-1GB", "1e9", "1.2.3GB", -5,
                                 2.5, None, True, "24GB extra"])  # fmt: skip
def test_parse_bytes_rejects_garbage(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


def test_render_is_a_table_with_shares():
    mb = ModelBytes.from_config(tiny(num_layers=4, vocab_size=5000, hidden_size=256))
    led = plan_ledger(mb, "11MiB", "100KiB", batch_capacity=2, max_len=128, workspace_floor=0)
    text = led.render()
    assert text.splitlines()[0] == "HBM budget 11.00 MiB (0.01 GB)"
    assert (led.tier0, led.tier1, led.tier2) == (8, 4, 20)
    parts = [
        "component", "GiB", "MB", "share", "dense + shared weights", "workspace", "free",
        "expert pool (8 slots)", "100.0%", "(budget 100.00 KiB)", "25.0% of experts in HBM",
        "fully resident needs an HBM budget of 11.37 MiB",
    ]  # fmt: skip
    for part in parts:
        assert part in text
    assert f"{led.dense:,}" in text


@settings(max_examples=200, deadline=None)
@given(
    hbm=st.integers(0, 2 * 10**7),
    host=st.one_of(st.none(), st.integers(0, 10**7)),
    batch=st.integers(1, 32),
    max_len=st.integers(0, 256),
    fraction=st.sampled_from([0.0, 0.05, 0.3]),
    floor=st.integers(0, 10**5),
    layers=st.integers(1, 6),
    experts=st.integers(1, 16),
)
def test_components_never_exceed_the_budget(
    hbm, host, batch, max_len, fraction, floor, layers, experts
):
    cfg = tiny(num_layers=layers, num_experts=experts, top_k=min(2, experts), hidden_size=64,
               expert_intermediate_size=96)  # fmt: skip
    mb = ModelBytes.from_config(cfg)
    kw = dict(batch_capacity=batch, max_len=max_len, workspace_fraction=fraction,
              workspace_floor=floor)  # fmt: skip
    try:
        led = plan_ledger(mb, hbm, host, **kw)
    except BudgetError as e:
        assert e.shortfall > 0
        assert e.ledger.used > hbm or e.ledger.pool_slots < e.ledger.staging_slots
        plan_ledger(mb, hbm + e.shortfall, host, **kw)  # the shortfall is exactly enough
        with pytest.raises(BudgetError):
            plan_ledger(mb, hbm + e.shortfall - 1, host, **kw)
        return
    parts = np.array([led.dense, led.kv_cache, led.staging, led.workspace, led.pool])
    assert (parts >= 0).all() and parts.sum() <= hbm and 0 <= led.free
    assert led.tier0 + led.tier1 + led.tier2 == mb.num_experts
    assert min(led.tier0, led.tier1, led.tier2) >= 0
    assert led.resident == (led.staging == 0) and led.pool_slots <= mb.num_experts
    if not led.resident:
        assert led.free < mb.bytes_per_expert  # nothing left that would hold another slot
    assert led.resident == (led.resident_budget <= hbm)


def test_default_staging_is_two_halves_of_a_quarter_gib_at_most():
    """Big experts: staging shrinks to what keeps the link busy (2 Mixtral bf16 experts at
    B=16, not the 8 a decode step can need); small experts: one decode step's worth."""
    bf16 = ModelBytes.from_config(synth_config("mixtral-8x7b", 8, None, "bfloat16"))
    assert default_staging_slots(bf16, 16) == 2 and default_staging_slots(bf16, 1) == 2
    int4 = ModelBytes.from_config(synth_config("mixtral-8x7b", 8, None, "bfloat16"),
                                  {"dense": "int8", "experts": "int4-g128"})
    assert default_staging_slots(int4, 16) == 6  # 2 x ceil(256 MiB / 86.6 MiB)
    qwen = synth_config("qwen3-30b-a3b", 4, None, "bfloat16")
    assert default_staging_slots(ModelBytes.from_config(qwen), 16) == 58  # 2 x 29 of 9 MiB
    qwen_int4 = ModelBytes.from_config(qwen, {"dense": "int8", "experts": "int4-g128"})
    assert default_staging_slots(qwen_int4, 16) == 16 * 8  # a decode step's worth: 128
    assert _plan(bf16, "8GiB", batch_capacity=16).staging_slots == 2


def test_default_max_len_is_the_context_within_a_quarter_of_the_budget(tmp_path):
    """Mixtral-8x7B's KV is 32 layers x K, V x 8 heads x 128 x 2 bytes = 128 KiB a token:
    16 rows take 2 MiB a position, so a quarter of 8 GiB holds 1,024 positions."""
    model = ModelBytes.from_config(synth_config("mixtral-8x7b"))
    assert model.kv_bytes_per_token == 128 * 1024
    length, why = default_max_len(model, 32768, 16, 8 * 1024**3)
    assert length == 1024 and "halved to 1024" in why and "32768" in why
    assert default_max_len(model, 32768, 1, 80 * 1024**3)[0] == 32768  # 4 GiB of KV fits
    assert default_max_len(model, 32768, 16, 1024)[0] == 256  # never below the floor
    assert default_max_len(model, None, 1, None)[0] == 4096
    assert default_max_len(model, 32768, 1, None)[0] == 4096  # no memory size: capped
    assert default_max_len(model, 1000, 1, None) == (1000, "max_len 1000: the model's "
                                                      "context, 1000 tokens (--max-len sets it)")
    from strata_runtime.engine.config import EngineConfig, context_max_len

    cfg = synth_config("tiny").replace(max_position=2048)
    write_checkpoint(cfg, tmp_path / "ck", seed=1)
    reader = CheckpointReader(tmp_path / "ck")
    assert reader.config.max_position == 2048
    kv = ModelBytes.from_reader(reader).kv_bytes_per_token * 4
    config, _ = context_max_len(EngineConfig(hbm_budget=kv * 2048 * 4, batch_capacity=4), reader)
    assert config.max_len == 2048
    config, why = context_max_len(EngineConfig(hbm_budget=kv * 2047 * 4, batch_capacity=4),
                                  reader)
    assert config.max_len == 1024 and "halved" in why


def test_the_linear_layers_state_is_counted_per_row():
    """A model with Gated DeltaNet layers (Qwen3-Next) keeps a fixed-size state per row beside
    the attention layers' cache: the ledger's line holds both, each row's state the bytes of
    the step's own zero state (`step.init_state`)."""
    from strata_jax.step import programs
    from tests.helpers import tiny_config

    cfg = tiny_config("qwen3_next")
    mb = ModelBytes.from_config(cfg)
    state = programs.init_state(cfg, 1, 10)
    assert mb.state_bytes_per_row == state.conv.nbytes + state.rec.nbytes > 0
    assert mb.kv_bytes_per_token * 10 == state.k.nbytes + state.v.nbytes
    led = _plan(mb, "1GiB", batch_capacity=3)
    assert led.recurrent and led.kv_cache == 3 * (10 * mb.kv_bytes_per_token
                                                  + mb.state_bytes_per_row)
    assert "recurrent state" in led.render() and not _plan(ModelBytes.from_config(tiny()),
                                                            "1GiB").recurrent
