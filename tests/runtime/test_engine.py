"""Offloaded generation is bit-identical to an unlimited budget."""

import numpy as np
import pytest

import strata_jax
from strata_runtime.engine import Engine, EngineConfig
from tests.helpers import tiny_config, write_checkpoint

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "ck"
    write_checkpoint(tiny_config("qwen2_moe"), path, seed=5)
    return path


def _run(ckpt, resident, host=None, predictor="both", policy="lfru"):
    engine = Engine.from_checkpoint(ckpt, EngineConfig(resident_experts=resident,
                                                       host_experts=host, batch_capacity=4,
                                                       max_len=32, predictor=predictor,
                                                       policy=policy))
    tokens, logits = engine.generate_with_logits(PROMPTS, 6)
    return tokens, logits, engine


SETTINGS = [(p, "lfru") for p in ("none", "history", "next-gate", "both")] + [
    ("both", policy) for policy in ("static", "lru", "lfu")
]


@pytest.mark.parametrize(("predictor", "policy"), SETTINGS)
def test_budgets_are_bit_identical_to_unlimited(ckpt, predictor, policy):
    ref_tokens, ref_logits, full = _run(ckpt, None, predictor=predictor, policy=policy)
    assert full.staged == 0
    total = full.cfg.num_layers * full.cfg.num_experts
    for fraction in (0.1, 0.35, 0.7):
        tokens, logits, engine = _run(ckpt, int(fraction * total), host=2, predictor=predictor,
                                      policy=policy)
        assert tokens == ref_tokens
        np.testing.assert_array_equal(logits, ref_logits)
        assert engine.staged > 0
        assert engine.store.stats.hits[2] > 0 and engine.store.stats.hits[1] > 0
        stats = engine.stats()["prediction"]
        recall = [v["recall"] for v in stats.values() if v["recall"] is not None]
        if predictor == "none":
            assert engine.stalls > 0 and all(r == 0 for r in recall)
        else:
            assert max(recall) > 0  # some misses were prefetched instead of stalling


@pytest.mark.parametrize("staging", [1, 2, 3])
def test_staging_slots_keep_bits_and_the_in_flight_bound(ckpt, staging):
    """Fewer staging slots than a layer needs: passes over alternating halves of the staging
    region, next pass's copies in flight while one computes, at most `staging` in flight."""
    ref_tokens, ref_logits, _ = _run(ckpt, None)
    engine = Engine.from_checkpoint(ckpt, EngineConfig(
        resident_experts=3, host_experts=4, batch_capacity=4, max_len=32, predictor="both",
        policy="static", staging_slots=staging))
    tokens, logits = engine.generate_with_logits(PROMPTS, 6)
    assert tokens == ref_tokens
    np.testing.assert_array_equal(logits, ref_logits)
    assert engine.staging == staging and engine.extra_passes > 0
    assert 0 < engine.max_in_flight <= staging


def test_row_chunks_keep_bits_under_offload_and_match_whole_batch_rows(ckpt):
    """Experts that multiply only their own rows: an offloaded run in passes is bit-identical
    to the unlimited one, and both agree with experts applied to the whole batch."""
    def run(**knobs):
        engine = Engine.from_checkpoint(ckpt, EngineConfig(
            batch_capacity=4, max_len=32, row_chunks=True, **knobs))
        return engine.generate_with_logits(PROMPTS, 6), engine

    (ref_tokens, ref_logits), _ = run()
    (tokens, logits), engine = run(resident_experts=3, host_experts=4, staging_slots=2)
    assert tokens == ref_tokens and engine.extra_passes > 0
    np.testing.assert_array_equal(logits, ref_logits)
    whole_tokens, whole_logits, _ = _run(ckpt, None)
    assert whole_tokens == ref_tokens
    np.testing.assert_allclose(whole_logits, ref_logits, rtol=1e-4, atol=1e-4)


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


def _experts_touched(ckpt, tokens):
    """Per request: the (layer, expert) pairs its prompt + generated tokens route to."""
    import jax

    from strata_jax import model as mdl

    m = strata_jax.load(ckpt)
    fn = jax.jit(mdl.forward_with_routing, static_argnums=0)
    touched = []
    for prompt, new in zip(PROMPTS, tokens, strict=True):
        seq = np.array([prompt + new[:-1]], np.int32)
        _, routes = fn(m.config, m.params, m.experts, m.slot_table, seq)
        routes = np.asarray(routes)
        touched.append({(layer, int(e)) for layer in range(routes.shape[0])
                        for e in routes[layer].ravel()})
    return touched


def test_corrupt_tier2_chunk_fails_only_requests_that_need_it(ckpt, tmp_path):
    import shutil

    ref_tokens, _, _ = _run(ckpt, 0, host=0)
    touched = _experts_touched(ckpt, ref_tokens)
    candidates = sorted(set.union(*touched) - set.intersection(*touched))
    assert candidates, "every request touches every expert; use shorter requests"
    layer, expert = candidates[0]
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    target = bad / "experts" / "w1" / "c" / str(layer) / str(expert) / "0" / "0"
    data = bytearray(target.read_bytes())
    data[7] ^= 0x55
    target.write_bytes(bytes(data))
    engine = Engine.from_checkpoint(bad, EngineConfig(resident_experts=0, host_experts=0,
                                                      batch_capacity=4, max_len=32))
    results = engine.generate_results(PROMPTS, 6)
    for i, r in enumerate(results):
        if (layer, expert) in touched[i]:
            assert r.error and f"layer {layer} expert {expert}" in r.error
        else:
            assert r.error is None and r.tokens == ref_tokens[i]
    healthy = [p for p, t in zip(PROMPTS, touched, strict=True) if (layer, expert) not in t]
    assert [r.tokens for r in engine.generate_results(healthy, 6)] == [
        t for t, s in zip(ref_tokens, touched, strict=True) if (layer, expert) not in s
    ]


def test_stats_and_timeline_export(ckpt, tmp_path):
    import json

    engine = Engine.from_checkpoint(ckpt, EngineConfig(resident_experts=2, host_experts=2,
                                                       batch_capacity=4, max_len=32,
                                                       timeline=True))
    engine.generate(PROMPTS, 6)
    stats = engine.stats()
    assert stats["decode_tok_s"] > 0 and stats["step_ms_p99"] >= stats["step_ms_p50"] > 0
    assert 0.0 <= stats["overlap_fraction"] <= 1.0 and stats["stall_ms"] >= 0
    assert stats["copy_ms"] > 0 and stats["stalls"] > 0
    moved = stats["h2d_copies"][1] + stats["h2d_copies"][2]
    assert moved == stats["fetches"][1] + stats["fetches"][2] > 0
    assert stats["h2d_bytes"][1] + stats["h2d_bytes"][2] >= stats["wasted_bytes"]
    engine.export_timeline(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    kinds = {e["cat"] for e in events}
    assert {"copy", "compute"} <= kinds and all(e["dur"] >= 0 for e in events)
