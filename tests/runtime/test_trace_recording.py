"""An engine run's routing trace: each request's picks, position by position, as the resident
forward routes them; the same trace for the same run; Belady above every policy on it."""

import numpy as np
import pytest

import strata_jax
from strata_runtime.engine import Engine, EngineConfig
from strata_runtime.simulate import compare, pinned_by_heat
from strata_runtime.trace import load_trace
from tests.helpers import tiny_config, write_checkpoint

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42], [9, 9, 9, 9, 9]]


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


def test_a_recorded_trace_is_each_requests_routing_and_repeats(ckpt, tmp_path):
    new = _record(ckpt, tmp_path / "a.npz")
    trace = load_trace(tmp_path / "a.npz")
    assert trace.prefill.any() and not trace.prefill.all()
    model = strata_jax.load(ckpt)
    for rid, (prompt, tokens) in enumerate(zip(PROMPTS, new, strict=True)):
        ref = strata_jax.api.routing(model, np.array([prompt + tokens[:-1]], np.int32))
        got = np.concatenate([trace.experts[lo:hi][trace.requests[lo:hi] == rid]
                              for lo, hi in zip(trace.offsets[:-1], trace.offsets[1:],
                                                strict=True)])
        np.testing.assert_array_equal(np.sort(got, -1),
                                      np.sort(np.transpose(ref, (1, 0, 2)), -1))
    assert _record(ckpt, tmp_path / "b.npz") == new
    again = load_trace(tmp_path / "b.npz")
    for name in ("experts", "rows", "requests", "offsets", "widths", "prefill"):
        np.testing.assert_array_equal(getattr(again, name), getattr(trace, name))
    for cache in (1, 3, 5):
        results, best = compare(trace, pinned=pinned_by_heat(trace, 2), cache=cache,
                                staging=2, admission="demand")
        assert all(best.hits >= r.hits for r in results)
