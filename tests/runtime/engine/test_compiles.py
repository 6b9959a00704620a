"""The engine compiles each step program once (also when a step resumes from a disk stall);
after the server's warm-up it compiles nothing and holds steady device memory, over 200 steps of a
continuous batch whose requests join, leave and are cancelled at any step."""

import collections
import logging
import re

import jax
import numpy as np
import pytest

from strata_jax.batching import packing
from strata_jax.batching.scheduler import Scheduler
from strata_jax.step.sampling import GREEDY, SamplingParams
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.serving.loop import warm_up
from tests.helpers import tiny_config, write_checkpoint


class _CompileCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Finished XLA compilation"):
            self.count += 1
            self.names.update(re.findall(r" of jit\((\w+)\)", message))


@pytest.fixture
def compiles():
    counter = _CompileCounter()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    jax.config.update("jax_log_compiles", True)
    yield counter
    jax.config.update("jax_log_compiles", False)
    logger.removeHandler(counter)


def test_no_compiles_and_stable_memory_over_200_steps(tmp_path, compiles):
    cfg = tiny_config("mixtral")
    write_checkpoint(cfg, tmp_path / "ck", seed=2)
    # prefill_chunk=32 (the default at max_len=48 is 64): the prompts (<= 16 tokens) still fit
    # one chunk, and warm-up compiles 6 packed shapes of up to 4 rows instead of 9
    engine = Engine.from_checkpoint(tmp_path / "ck", EngineConfig(
        resident_experts=4, host_experts=2, batch_capacity=4, max_len=48, policy="lru",
        prefill_chunk=32))
    rng = np.random.default_rng(0)

    def prompt(length):
        return rng.integers(0, cfg.vocab_size, length).tolist()

    sampled = SamplingParams(temperature=0.8, top_k=20, seed=3)
    # a batch that stalls on disk and runs again from a layer, then the server's warm-up:
    # every packed prefill shape and decode with and without the sampler
    engine.generate([prompt(12) for _ in range(4)], 11, [GREEDY] * 3 + [sampled])
    assert engine.stats()["resumed_layers"] > 0
    warm_up(engine)
    live = sum(a.nbytes for a in jax.live_arrays())
    assert compiles.count > 0  # the counter sees compilations at all
    shapes = packing.shapes(engine.prefill_chunk, engine.prefill_rows)
    assert compiles.names["prefill_step"] == len(shapes) > 4, compiles.names
    assert compiles.names["decode_step"] == 2, compiles.names
    compiles.count = 0
    sched, reqs, joined_late = Scheduler(engine), [], 0
    while sched.steps < 200:  # requests join and leave at any step, greedy or sampled
        if rng.random() < 0.3 or not reqs:
            busy = any(r is not None and not r.done for r in sched.rows)
            joined_late += busy
            reqs.append(sched.submit(prompt(int(rng.integers(1, 17))), int(rng.integers(1, 20)),
                                     sampled if rng.random() < 0.3 else GREEDY))
        if rng.random() < 0.03 and reqs:
            sched.cancel(reqs[int(rng.integers(len(reqs)))])
        sched.step()
    sched.run()
    assert compiles.count == 0
    finished = [r for r in reqs if not r.cancelled]
    assert joined_late > 20 and len(finished) > 30
    assert all(r.error is None and len(r.tokens) == r.max_new_tokens for r in finished)
    # every buffer was allocated at start-up; only the last step's small record may differ
    assert sum(a.nbytes for a in jax.live_arrays()) <= live + (64 << 10)
