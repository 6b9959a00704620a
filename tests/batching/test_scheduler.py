"""Continuous batching: requests join and leave at any step; results equal one-by-one runs."""

import numpy as np
import pytest

from strata_jax.batching.contract import StepResult
from strata_jax.batching.packing import Prefilled
from strata_jax.batching.scheduler import Scheduler
from strata_jax.step.sampling import SamplingParams
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from tests.helpers import tiny_config, write_checkpoint

KEEP_PROGRAMS = True  # every engine here has one layout (tests/runtime/conftest.py)


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
    early = sched.submit([4, 8, 15], 8, SamplingParams(stop_ids={stop}))
    sched.run()
    assert early.tokens == streamed[: streamed.index(stop) + 1]


def test_a_cancelled_request_frees_its_row_for_the_queue(engine_factory):
    sched = Scheduler(engine_factory())  # 3 rows
    reqs = [sched.submit([7, i + 1], 10) for i in range(3)]
    waiting = sched.submit([3, 1, 4], 5)
    sched.step()
    sched.step()
    sched.cancel(reqs[1])
    assert reqs[1].done and reqs[1].cancelled and len(reqs[1].tokens) == 3  # prefill + 2
    sched.step()
    assert sched.rows[1] is waiting  # took the cancelled row at once
    sched.cancel(waiting)
    queued = sched.submit([2, 2], 4)
    sched.cancel(queued)  # still queued: never prefilled
    sched.run()
    single = engine_factory()
    assert not queued.tokens and queued not in sched.queue
    for i in (0, 2):
        assert reqs[i].tokens == single.generate([[7, i + 1]], 10)[0]


def test_bad_requests_are_refused(engine_factory):
    sched = Scheduler(engine_factory())
    with pytest.raises(ValueError, match="the prompt is empty"):
        sched.submit([], 3)
    with pytest.raises(ValueError, match="max_len"):
        sched.submit([1] * 30, 20)


def test_kept_request_resumes_from_its_kv(engine_factory):
    sched = Scheduler(engine_factory())
    chat = sched.submit([4, 8, 15], 5, keep=True)
    sched.run()
    first = list(chat.tokens)
    assert chat.done and sched.rows.count(chat) == 1  # idle, still holding its row and KV
    sched.resume(chat, [16, 23], 6)
    assert list(sched.stream(chat)) == chat.tokens[5:] and len(chat.tokens) == 11
    history = [4, 8, 15] + first + [16, 23]
    assert chat.tokens[5:] == engine_factory().generate([history], 6)[0]
    assert sched.evictions == 0


def test_oldest_idle_request_is_evicted_and_resumed_by_prefill(engine_factory):
    sched = Scheduler(engine_factory())  # 3 rows
    kept = [sched.submit([3 + i, 9, 1], 4, keep=True) for i in range(3)]
    sched.run()
    sched.resume(kept[1], [7], 2)  # kept[1] becomes the most recently active
    sched.run()
    newcomer = sched.submit([5, 5, 5], 3)
    sched.run()
    assert sched.evictions == 1 and kept[0].evicted and not kept[2].evicted
    assert newcomer.tokens == engine_factory().generate([[5, 5, 5]], 3)[0]
    history = list(kept[0].sequence)
    sched.resume(kept[0], [2, 6], 4)
    sched.run()
    assert kept[0].tokens[4:] == engine_factory().generate([history + [2, 6]], 4)[0]


def test_only_idle_kept_requests_resume(engine_factory):
    sched = Scheduler(engine_factory())
    plain = sched.submit([1, 2], 2)
    with pytest.raises(ValueError, match="not an idle kept request"):
        sched.resume(plain, [3], 2)
    sched.run()
    with pytest.raises(ValueError, match="not an idle kept request"):
        sched.resume(plain, [3], 2)
    kept = sched.submit([1, 2], 2, keep=True)
    sched.run()
    with pytest.raises(ValueError, match="max_len"):
        sched.resume(kept, [1] * 30, 20)


class _LoggingEngine:
    """A deterministic fake for the loop's order: each live row's next token is its last +1."""

    cfg = tiny_config("olmoe")
    capacity, max_len = 2, 32

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.last: dict[int, int] = {}
        self.n = 0
        self.numbers: dict[int, int] = {}

    def prefill(self, admissions, ride=None):  # nothing rides: the loop's order alone
        out = []
        for a in admissions:
            self.calls.append(("prefill", a.row))
            self.last[a.row] = a.tokens[-1] + 1
            out.append(Prefilled(self.last[a.row]))
        return out

    def step(self) -> StepResult:
        self.n += 1
        self.calls.append(("step", self.n))
        out = np.zeros(self.capacity, np.int32)
        for row in self.last:
            self.last[row] += 1
            out[row] = self.last[row]
        result = StepResult(out, {}, None)
        self.numbers[id(result)] = self.n
        return result

    def read(self, result: StepResult):
        self.calls.append(("read", self.numbers[id(result)], self.n))
        return result.tokens

    def free(self, row) -> None:
        self.calls.append(("free", row))
        self.last.pop(row)


def test_step_n_plus_one_is_dispatched_before_step_n_is_read():
    engine = _LoggingEngine()
    sched = Scheduler(engine)
    a = sched.submit([10], 4)
    b = sched.submit([50], 5, SamplingParams(stop_ids={52}))
    sched.run()
    assert a.tokens == [11, 12, 13, 14] and b.tokens == [51, 52]
    loop = [c for c in engine.calls if c[0] != "prefill"]
    # (read, step read, steps dispatched so far): step n + 1 is on its way when n is read;
    # b stops on 52 in step 1, its token of step 2 is dropped; a's budget needs no step 4
    assert loop == [("step", 1), ("step", 2), ("read", 1, 2), ("free", 1), ("step", 3),
                    ("read", 2, 3), ("read", 3, 3), ("free", 0)]


def test_a_stopped_kept_request_resumes_as_a_fresh_run_under_repetition_penalty(
        engine_factory):
    penalty = SamplingParams(repetition_penalty=1.7)
    free_run = engine_factory().generate([[4, 8, 15]], 8, penalty)[0]
    stop = free_run[3]
    sched = Scheduler(engine_factory())
    chat = sched.submit([4, 8, 15], 8, SamplingParams(repetition_penalty=1.7,
                                                      stop_ids={stop}), keep=True)
    sched.run()  # a step beyond the stop was dispatched and its token dropped
    assert chat.tokens == free_run[: free_run.index(stop) + 1]
    turn = len(chat.tokens)
    history = list(chat.sequence) + [16, 23]
    sched.resume(chat, [16, 23], 5)
    sched.run()
    fresh = engine_factory().generate([history], 5, penalty)[0]
    assert chat.tokens[turn:] == fresh[: len(chat.tokens) - turn]
    assert len(chat.tokens) - turn >= 1
