"""An engine run's routing trace: each request's picks, position by position, as the resident
forward routes them; the same trace for the same run; Belady above every policy on it; a
trace replayed (`replay_trace`) forces the routing, and a run's own trace gives its tokens."""

import numpy as np
import pytest

import strata_jax
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.engine.trace import TraceError, load_trace, save_trace, synthetic_trace
from strata_runtime.lab.simulate import compare, pinned_by_heat
from tests.helpers import tiny_config, write_checkpoint
from tests.runtime.contract import routing, run_rows

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42], [9, 9, 9, 9, 9]]
KEEP_PROGRAMS = True  # engines of one layout share their programs (tests/runtime/conftest.py)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "ck"
    write_checkpoint(tiny_config("qwen2_moe"), path, seed=5)
    return path


def _record(ckpt, path):
    config = EngineConfig(batch_capacity=2, max_len=32, resident_experts=3,
                          record_trace=str(path))
    with Engine.from_checkpoint(ckpt, config) as engine:  # 4 requests through 2 rows
        return engine.generate(PROMPTS, 6)


@pytest.fixture(scope="module")
def recorded(ckpt, tmp_path_factory):
    """(the new tokens, the trace file) of one recorded run."""
    path = tmp_path_factory.mktemp("recorded") / "a.npz"
    return _record(ckpt, path), path


def _assert_is_routing(trace, ckpt, prompts, new) -> None:
    """Each request's picks in `trace`, position by position, are the resident forward's of
    its prompt and new tokens (the last one's routing is never run)."""
    refs = routing(strata_jax.load(ckpt), [p + t[:-1] for p, t in zip(prompts, new, strict=True)])
    for rid, ref in enumerate(refs):
        got = np.concatenate([trace.experts[lo:hi][trace.requests[lo:hi] == rid]
                              for lo, hi in zip(trace.offsets[:-1], trace.offsets[1:],
                                                strict=True)])
        np.testing.assert_array_equal(np.sort(got, -1),
                                      np.sort(np.transpose(ref, (1, 0, 2)), -1))


def test_a_recorded_trace_is_each_requests_routing_and_repeats(ckpt, recorded, tmp_path):
    new, path = recorded
    trace = load_trace(path)
    assert trace.prefill.any() and not trace.prefill.all()
    _assert_is_routing(trace, ckpt, PROMPTS, new)
    assert _record(ckpt, tmp_path / "b.npz") == new
    again = load_trace(tmp_path / "b.npz")
    for name in ("experts", "rows", "requests", "offsets", "widths", "prefill"):
        np.testing.assert_array_equal(getattr(again, name), getattr(trace, name))
    for cache in (1, 3, 5):
        results, best = compare(trace, pinned=pinned_by_heat(trace, 2), cache=cache,
                                staging=2, admission="demand")
        assert all(best.hits >= r.hits for r in results)


def test_replaying_a_runs_own_trace_gives_its_tokens_and_its_trace(ckpt, recorded, tmp_path):
    new, path = recorded
    config = EngineConfig(batch_capacity=2, max_len=32, resident_experts=3,
                          record_trace=str(tmp_path / "b.npz"), replay_trace=str(path))
    with Engine.from_checkpoint(ckpt, config) as engine:
        assert engine.generate(PROMPTS, 6) == new
        assert engine.stats()["replay_wraps"] == 0
    a, b = load_trace(path), load_trace(tmp_path / "b.npz")
    for name in ("experts", "rows", "requests", "offsets", "widths", "prefill"):
        np.testing.assert_array_equal(getattr(b, name), getattr(a, name))


def test_a_synthetic_trace_forces_the_routing_and_offload_stays_exact(ckpt, tmp_path):
    cfg = tiny_config("qwen2_moe")
    synth = synthetic_trace(cfg.num_layers, cfg.num_experts, cfg.top_k, steps=3, rows=2,
                            skew=1.0, seed=3)
    save_trace(tmp_path / "synth.npz", synth)
    runs = []
    for knobs in ({}, {"resident_experts": 3}):
        config = EngineConfig(batch_capacity=2, max_len=32, record_trace=str(
            tmp_path / f"got{len(runs)}.npz"), replay_trace=str(tmp_path / "synth.npz"),
            **knobs)
        with Engine.from_checkpoint(ckpt, config) as engine:
            runs.append(run_rows(engine, PROMPTS[:2], 6))  # 5 decode steps: the trace wraps
            assert engine.stats()["replay_wraps"] == 1
    np.testing.assert_array_equal(runs[1][0], runs[0][0])
    np.testing.assert_array_equal(runs[1][1], runs[0][1])
    got = load_trace(tmp_path / "got1.npz")
    decode = np.flatnonzero(~got.prefill)
    for i, step in enumerate(decode):
        np.testing.assert_array_equal(got.step_experts(step), synth.step_experts(i % 3))


def test_a_trace_of_another_model_is_refused(ckpt, tmp_path):
    save_trace(tmp_path / "other.npz", synthetic_trace(3, 6, 2, steps=2, rows=1, skew=0.0,
                                                       seed=0))
    with pytest.raises(TraceError, match="other.npz: recorded for 3 layers x 6 experts"):
        Engine.from_checkpoint(ckpt, EngineConfig(batch_capacity=2, max_len=32,
                                                  replay_trace=str(tmp_path / "other.npz")))


def test_a_deepseek_runs_trace_is_its_routing_and_replays_its_tokens(tmp_path):
    """DeepSeek-V3's grouped sigmoid routing (a dense first layer before the MoE layers): the
    recorded trace holds each request's picks as the resident forward makes them, and
    replaying it offloaded gives the run's tokens."""
    ckpt = tmp_path / "ds"
    write_checkpoint(tiny_config("deepseek_v3"), ckpt, seed=6)
    prompts = PROMPTS[:2]
    config = EngineConfig(batch_capacity=2, max_len=32, resident_experts=3,
                          record_trace=str(tmp_path / "a.npz"))
    with Engine.from_checkpoint(ckpt, config) as engine:
        new = engine.generate(prompts, 5)
    trace = load_trace(tmp_path / "a.npz")
    _assert_is_routing(trace, ckpt, prompts, new)
    replay = EngineConfig(batch_capacity=2, max_len=32, resident_experts=2,
                          replay_trace=str(tmp_path / "a.npz"))
    with Engine.from_checkpoint(ckpt, replay) as engine:
        assert engine.generate(prompts, 5) == new
