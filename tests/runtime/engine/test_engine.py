"""The engine at any budget, policy and predictor gives the resident bits, through the one
compiled step; bad requests and corrupt chunks fail alone."""

import collections
import glob
import gzip
import json
import re
import shutil
import tempfile

import jax
import numpy as np
import pytest

import strata_jax
from strata_jax.batching.packing import Admission
from strata_jax.batching.requests import RequestFailed, RequestResult
from strata_jax.formats.checkpoint import CheckpointError
from strata_jax.step import programs as step
from strata_jax.step.sampling import GREEDY, SamplingParams
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.residency.ledger import BudgetError
from tests.helpers import tiny_config, write_checkpoint
from tests.runtime.contract import routing, run_rows

# <= 8 tokens: one prefill bucket, so each engine compiles two programs, not three (a longer
# prompt, offloaded: test_engine_matches_the_resident_api_...)
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [42]]
SHAPE = dict(batch_capacity=4, max_len=32)
KEEP_PROGRAMS = True  # engines of one layout share their programs (tests/runtime/conftest.py)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "ck"
    write_checkpoint(tiny_config("qwen2_moe"), path, seed=5)
    return path


def _engine(ckpt, **knobs):
    return Engine.from_checkpoint(ckpt, EngineConfig(**SHAPE, **knobs))


@pytest.fixture(scope="module")
def reference(ckpt):
    with _engine(ckpt) as engine:
        assert engine.layout.resident and engine.layout.staging == 0
        return run_rows(engine, PROMPTS, 6)


# every predictor x policy x dequant on four models: test_exactness_matrix.py; here the
# counters that say each mechanism ran (prediction recall, cache admissions)
@pytest.mark.parametrize(("predictor", "policy"), [("none", "static"), ("next-gate", "lfru")])
def test_budgets_are_bit_identical_to_unlimited(ckpt, reference, predictor, policy):
    ref_tokens, ref_logits = reference
    total = 2 * 6
    for fraction in (0.1, 0.35, 0.7):
        with _engine(ckpt, resident_experts=int(fraction * total), predictor=predictor,
                     policy=policy) as engine:
            tokens, logits = run_rows(engine, PROMPTS, 6)
            stats = engine.stats()
        np.testing.assert_array_equal(tokens, ref_tokens)
        np.testing.assert_array_equal(logits, ref_logits)
        assert stats["misses_per_step"] > 0
        recall = stats["prediction"]["recall"]
        assert (recall == 0) == (predictor == "none")
        if policy != "static" and fraction > 0.2:
            assert stats["admissions"] > 0


def test_cache_admission_rules_keep_the_bits(ckpt, reference):
    """"hotter" admits a subset of what "always" admits when the cache is full; neither
    changes a bit (which slot holds an expert is not in the math)."""
    admitted = {}
    for rule in ("always", "hotter"):
        with _engine(ckpt, resident_experts=4, cache_fraction=0.5, cache_admit=rule) as engine:
            tokens, logits = run_rows(engine, PROMPTS, 6)
            admitted[rule] = engine.stats()["admissions"]
        np.testing.assert_array_equal(tokens, reference[0])
        np.testing.assert_array_equal(logits, reference[1])
    assert 0 < admitted["hotter"] <= admitted["always"]


@pytest.mark.parametrize("staging", [1, 2, 3])
def test_fewer_staging_slots_than_a_layer_needs(ckpt, reference, staging):
    with _engine(ckpt, resident_experts=3, policy="static", staging_slots=staging) as engine:
        assert engine.layout.staging == staging
        tokens, logits = run_rows(engine, PROMPTS, 6)
    np.testing.assert_array_equal(tokens, reference[0])
    np.testing.assert_array_equal(logits, reference[1])


def test_row_chunks_keep_the_bits_offloaded(ckpt):
    with _engine(ckpt, row_chunks=True) as full, _engine(
            ckpt, row_chunks=True, resident_experts=3, staging_slots=2) as offloaded:
        ref = run_rows(full, PROMPTS, 6)
        got = run_rows(offloaded, PROMPTS, 6)
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])


def test_engine_matches_the_resident_api_queues_any_number_and_samples_per_row(ckpt):
    """9 requests through 4 rows, seeded sampling, penalties and greedy rows sharing batches,
    one prompt past the first prefill bucket: the resident API's bits."""
    settings = [SamplingParams(temperature=1.0, top_p=0.9, seed=3),
                SamplingParams(repetition_penalty=1.5),
                SamplingParams(temperature=0.7, top_k=4, min_p=0.1, seed=8), GREEDY,
                SamplingParams(temperature=1.2, seed=11, repetition_penalty=1.2)] + [GREEDY] * 4
    prompts = PROMPTS * 3
    prompts[7] = list(range(1, 13))  # a 16-token prefill chunk, greedy
    model = strata_jax.load(ckpt)
    ref = strata_jax.generate(model, prompts, 6, sampling=settings, **SHAPE)
    # 4 experts in HBM, the default predictor and policy: the greedy programs are those of
    # test_budgets_are_bit_identical_to_unlimited[next-gate-lfru]
    with _engine(ckpt, resident_experts=4) as engine:
        assert engine.generate(prompts, 6, sampling=settings) == ref
    assert prompts[3] == prompts[0] and settings[3] == GREEDY  # the sampler changed the tokens
    assert ref[0] != ref[3]


def test_a_request_does_not_depend_on_its_batch(ckpt):
    with _engine(ckpt, resident_experts=4) as engine:
        alone = [engine.generate([p], 6)[0] for p in PROMPTS]
        assert engine.generate(PROMPTS + [[9, 9, 9, 9]], 6)[:3] == alone


def test_bad_requests_are_named_and_fail_alone(ckpt):
    # the programs of test_budgets_are_bit_identical_to_unlimited[next-gate-lfru] at 4 experts
    with _engine(ckpt, resident_experts=4) as engine:
        good = engine.generate([[1, 5, 2]], 4)[0]
        for prompts, new, message in (
            ([[1, 5, 2], [2, 300]], 4, "request 1: token id 300 is outside"),
            ([[1, 5, 2], []], 4, "request 1: the prompt is empty"),
            ([[1, 5, 2], [1] * 30], 4, "request 1: 30 prompt \\+ 4 new tokens exceed max_len=32"),
        ):
            with pytest.raises(RequestFailed, match=message) as failed:
                engine.generate(prompts, new)
            ok, bad = failed.value.results
            assert ok == RequestResult(good) and bad.tokens == [] and bad.error, message
        with pytest.raises(RequestFailed, match="request 0: max_new_tokens must be >= 1"):
            engine.generate([[1]], 0)
        with pytest.raises(ValueError, match="row 0: token id -1 is outside the vocabulary"):
            engine.prefill([Admission(0, [1, -1])])  # the contract checks what it is given


def test_budget_goes_through_the_ledger(ckpt):
    # no workspace: dense + KV cache alone exceed 64 KiB (the measured workspace, which
    # compiles the step programs: test_workspace.py)
    with pytest.raises(BudgetError, match="too small"):
        _engine(ckpt, hbm_budget="64KiB", workspace=0)
    with _engine(ckpt, hbm_budget="1GiB", host_budget="1MiB", workspace=0) as engine:
        assert engine.layout.ledger.resident and engine.layout.resident


def _touched(ckpt, tokens):
    """Per request: the (layer, expert) pairs its prompt and generated tokens route to."""
    seqs = [prompt + new[:-1] for prompt, new in zip(PROMPTS, tokens, strict=True)]
    return [{(layer, int(e)) for layer in range(r.shape[0]) for e in r[layer].ravel()}
            for r in routing(strata_jax.load(ckpt), seqs)]


@pytest.mark.parametrize("read_ahead", [0, 4])
def test_experts_only_on_disk_give_the_same_bits(ckpt, reference, read_ahead):
    """Tier 1 holds one layer's experts (6 of the 10 not in HBM): steps stall on disk at
    a layer and resume there, experts are read again after eviction (and ahead of need by
    heat, in the background), the bits stay."""
    with _engine(ckpt, resident_experts=2, host_experts=0, policy="static",
                 read_ahead=read_ahead) as engine:
        assert engine.plan.resume and len(engine.residency.host_key) == 6
        tokens, logits = run_rows(engine, PROMPTS, 6)
        stats = engine.stats()
    np.testing.assert_array_equal(tokens, reference[0])
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(logits, reference[1])
    else:  # the resume's selects change the GPU's fusion of f32 layers (docs/design.md)
        np.testing.assert_allclose(logits, reference[1], rtol=1e-4, atol=1e-5)
    assert stats["disk_loads"] > 10 and stats["disk_bytes"] > 0
    bpe = engine.counters.bytes_per_expert
    assert stats["read_ahead_bytes"] == stats["read_ahead_loads"] * bpe
    if not read_ahead:
        assert stats["read_ahead_loads"] == 0


def test_close_frees_the_engine_memory_at_once(ckpt, reference):
    """A process that builds engines one after another (a sweep, a notebook) gets an engine's
    device slots, tier 1, params and KV back when it is closed, not when the collector runs;
    its stats stay readable and it refuses to step again."""
    before = {id(a) for a in jax.live_arrays()}
    engine = _engine(ckpt, resident_experts=2, host_experts=0, policy="static")
    tokens, _ = run_rows(engine, PROMPTS, 6)
    np.testing.assert_array_equal(tokens, reference[0])
    held = [a for a in jax.live_arrays() if id(a) not in before]
    kinds = {a.sharding.memory_kind for a in held}
    assert len(held) > 5 and "pinned_host" in kinds, kinds  # the pools, params, KV, tables
    engine.close()
    assert all(a.is_deleted() for a in held)
    assert not [a for a in jax.live_arrays() if id(a) not in before]
    assert engine.stats()["disk_loads"] > 0
    with pytest.raises(RuntimeError, match="closed"):
        engine.prefill([Admission(0, [1, 2])])
    engine.close()  # twice is fine


def test_a_stall_loads_the_later_layers_disk_experts_too(tmp_path):
    """With `disk_lookahead` a stalled step also loads the disk experts its later layers
    routed to (on the stalled layer's incomplete output): fewer layers run again, no more
    disk loads, the resident bits either way."""
    path = tmp_path / "deep"
    write_checkpoint(tiny_config("qwen2_moe", num_layers=4, num_experts=8), path, seed=5)
    with Engine.from_checkpoint(path, EngineConfig(**SHAPE)) as engine:
        ref_tokens, ref_logits = run_rows(engine, PROMPTS, 6)
    stats = {}
    for lookahead in (False, True):
        config = EngineConfig(**SHAPE, resident_experts=4, host_experts=20, policy="static",
                              disk_lookahead=lookahead)
        with Engine.from_checkpoint(path, config) as engine:
            tokens, logits = run_rows(engine, PROMPTS, 6)
            stats[lookahead] = engine.stats()
        np.testing.assert_array_equal(tokens, ref_tokens)
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(logits, ref_logits)
    assert stats[False]["resumed_layers"] > stats[True]["resumed_layers"] > 0
    assert stats[False]["disk_loads"] >= stats[True]["disk_loads"] > 0


def test_corrupt_chunk_fails_only_the_requests_that_need_it(ckpt, reference, tmp_path):
    ref_tokens = reference[0].tolist()
    touched = _touched(ckpt, ref_tokens)
    candidates = sorted(set.union(*touched) - set.intersection(*touched))
    assert candidates, "every request touches every expert; use shorter requests"
    pinning = dict(resident_experts=11, host_experts=0)
    with _engine(ckpt, **pinning) as engine:
        pinned = engine.shares[0].pinned
    layer, expert = next(c for c in candidates if c in pinned)  # pinned where `pinning`
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    target = bad / "experts" / "w1" / "c" / str(layer) / str(expert) / "0" / "0"
    data = bytearray(target.read_bytes())
    data[7] ^= 0x55
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"expert {expert} of layer {layer}"):
        _engine(bad)  # resident: no miss path to fail its requests alone
    # on disk, in tier 1, or among the pinned (left out of its slot: a miss on disk); the first
    # two are the layouts (and programs) of test_experts_only_on_disk_give_the_same_bits and of
    # test_budgets_are_bit_identical_to_unlimited[next-gate-lfru] at 4 experts, whose pinned
    # experts leave the broken one out
    on_disk, in_tier1 = dict(resident_experts=2, host_experts=0), dict(resident_experts=4)
    for knobs in (on_disk, in_tier1, pinning):
        with _engine(bad, **knobs) as engine:
            assert knobs is pinning or (layer, expert) not in engine.shares[0].pinned
            results = engine.generate_results(PROMPTS, 6)
            for i, r in enumerate(results):
                if (layer, expert) in touched[i]:
                    assert r.error and f"expert {expert} of layer {layer}" in r.error
                else:
                    assert r.error is None and r.tokens == ref_tokens[i]
            healthy = [p for p, t in zip(PROMPTS, touched, strict=True)
                       if (layer, expert) not in t]
            assert engine.generate(healthy, 6) == [
                t for t, s in zip(ref_tokens, touched, strict=True) if (layer, expert) not in s]


def test_stats_and_timeline_export(ckpt, tmp_path):
    # the programs of test_budgets_are_bit_identical_to_unlimited[next-gate-lfru] at 4 experts
    with _engine(ckpt, resident_experts=4, timeline=True) as engine:
        engine.generate(PROMPTS, 6)
        engine.reset_stats()
        engine.generate(PROMPTS, 6)
        stats = engine.stats()
        engine.export_timeline(tmp_path / "trace.json")
    assert stats["decode_tok_s"] > 0 and stats["step_ms_p99"] >= stats["step_ms_p50"] > 0
    assert stats["compile_s"] == 0  # warm: nothing compiled in the measured run
    assert 0 <= stats["tier0_hit_rate"] <= 1 and stats["h2d_bytes"] > 0
    assert stats["h2d_bytes"] >= stats["h2d_wasted_bytes"] >= 0
    assert stats["link_gbps"] > 0 and stats["link_busy"] > 0
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in events}  # a packed prefill program: prefill{rows}x{tokens}
    assert "decode" in names and any(re.fullmatch(r"prefill\d+x\d+", n) for n in names)



def _programs_dispatched(fn) -> collections.Counter:
    """The jitted programs `fn()` dispatches, by name, from a profiler trace (the C++ dispatch
    path has no Python hook to count with)."""
    where = tempfile.mkdtemp()
    with jax.profiler.trace(where, create_perfetto_trace=True):
        fn()
    path = glob.glob(f"{where}/**/*perfetto_trace.json.gz", recursive=True)[0]
    trace = json.load(gzip.open(path))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = [e["name"] for e in events if e.get("ph") == "X"]
    shutil.rmtree(where)
    return collections.Counter(n[len("PjitFunction("):-1] for n in names
                               if n.startswith("PjitFunction("))


@pytest.mark.parametrize(("knobs", "between_steps"), [
    (dict(policy="static"), set()),
    (dict(policy="lru"), {"_pull"}),
    (dict(policy="lru", host_experts=10), {"_pull", "_put_host"}),  # tier 2 too
])  # fmt: skip
def test_one_program_per_engine_step_and_no_host_read_inside(ckpt, knobs, between_steps):
    """Engine.step dispatches the decode program once (a step that stalls on disk, again
    from its layer) and nothing else but the packing of its record into one array, the
    tiers' moves, donated updates of the pool and of tier 1 between steps (docs/design.md,
    "The engine"); the program itself moves nothing
    to the host (its record is read a step later, or at once where a step may stall) and
    calls nothing on the host."""
    with _engine(ckpt, resident_experts=4, predictor="none", **knobs) as engine:
        engine.prefill([Admission(row, prompt) for row, prompt in enumerate(PROMPTS)])
        for _ in range(3):  # compiles, and fills the cache
            engine.step()
        steps = 4
        dispatched = _programs_dispatched(lambda: [engine.step() for _ in range(steps)])
        assert set(dispatched) <= {"decode_step", "pack_record"} | between_steps, dispatched
        assert dispatched["decode_step"] >= steps
        assert dispatched["pack_record"] <= dispatched["decode_step"]
        program = step.PROGRAMS[engine.layout.staging > 0].decode
        text = program.lower(engine.cfg, engine.plan, engine.params, engine.residency.pool,
                             engine._tiers(), engine.state).as_text()
        assert "callback" not in text, "a host call inside the step"
