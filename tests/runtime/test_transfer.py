"""The transfer engine's threads: NUMA binding, copies of pinned and fetched experts."""

import os

import jax
import numpy as np
import pytest

from strata_runtime.numa import NumaPlan
from strata_runtime.timeline import Timeline
from strata_runtime.transfer import TransferEngine

ARRAYS = {"w1": np.arange(12, dtype=np.float32).reshape(3, 4), "w2": np.ones((4, 3), np.int8)}


def _engine(plan: NumaPlan, timeline: bool = False) -> TransferEngine:
    return TransferEngine(lambda layer, e: (2, ARRAYS), jax.devices()[0], 2, plan,
                          Timeline(timeline))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity API")
def test_fetch_threads_are_bound_to_the_plans_cpus():
    before = os.sched_getaffinity(0)
    cpu = min(before)
    engine = _engine(NumaPlan(node=0, cpus=(cpu,), reason="test"))
    try:
        seen = [engine.executor.submit(os.sched_getaffinity, 0).result() for _ in range(8)]
        assert all(s == {cpu} for s in seen)
    finally:
        engine.close()
    assert os.sched_getaffinity(0) == before  # the calling thread is left alone


def test_pinned_and_fetched_copies_arrive_and_are_counted():
    engine = _engine(NumaPlan(node=None, cpus=(), reason="single node"), timeline=True)
    try:
        fetched = engine.start(0, 1, None)
        pinned = engine.start(0, 2, ARRAYS)
        for t in (fetched, pinned):
            got = t.result()
            for k, v in ARRAYS.items():
                np.testing.assert_array_equal(np.asarray(got[k]), v)
        assert (fetched.tier, pinned.tier) == (2, 1)
        size = sum(a.nbytes for a in ARRAYS.values())
        assert engine.stats.bytes == {1: size, 2: size}
        engine.wasted(pinned)
        assert engine.stats.wasted_bytes == size
        engine.computed("experts", jax.numpy.ones(3), (fetched, pinned))
        engine.drain()
        kinds = {s.kind for s in engine.timeline.spans}
        assert {"copy", "compute"} <= kinds
    finally:
        engine.close()
