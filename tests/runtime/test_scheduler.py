"""Continuous batching: requests join and leave at any step; results equal one-by-one runs."""

import numpy as np
import pytest

from strata_runtime.engine import Engine, EngineConfig
from strata_runtime.scheduler import Scheduler
from tests.helpers import tiny_config, write_checkpoint


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory):
    path = tmp_path_factory.mktemp("sched") / "ck"
    write_checkpoint(tiny_config("olmoe"), path, seed=9)

    def make():
        return Engine.from_checkpoint(path, EngineConfig(resident_experts=3, host_experts=3,
                                                         batch_capacity=3, max_len=40))
    return make


def test_requests_joining_mid_run_match_single_runs(engine_factory):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 97, n).tolist() for n in (3, 7, 2, 9, 5)]
    limits = [6, 4, 8, 5, 7]
    sched = Scheduler(engine_factory())
    reqs = [sched.submit(prompts[0], limits[0]), sched.submit(prompts[1], limits[1])]
    sched.step()
    sched.step()
    reqs += [sched.submit(p, n) for p, n in zip(prompts[2:], limits[2:], strict=True)]
    sched.run()
    single = engine_factory()
    for req, p, n in zip(reqs, prompts, limits, strict=True):
        assert req.done and req.error is None and len(req.tokens) == n
        assert req.tokens == single.generate([p], n)[0]


def test_stop_ids_and_streaming(engine_factory):
    sched = Scheduler(engine_factory())
    full = sched.submit([4, 8, 15], 8)
    streamed = list(sched.stream(full))
    assert streamed == full.tokens and len(streamed) == 8
    stop = streamed[3]
    early = sched.submit([4, 8, 15], 8, stop_ids={stop})
    sched.run()
    assert early.tokens == streamed[: streamed.index(stop) + 1]


def test_bad_requests_are_refused(engine_factory):
    sched = Scheduler(engine_factory())
    with pytest.raises(ValueError, match="non-empty"):
        sched.submit([], 3)
    with pytest.raises(ValueError, match="max_len"):
        sched.submit([1] * 30, 20)
