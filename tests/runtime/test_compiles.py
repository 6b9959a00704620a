"""The engine compiles each step program once (also when a step resumes from a disk stall);
after warm-up it compiles nothing and holds steady device memory."""

import collections
import logging
import re

import jax
import numpy as np
import pytest

from strata_runtime.engine import Engine, EngineConfig
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
    engine = Engine.from_checkpoint(tmp_path / "ck", EngineConfig(
        resident_experts=4, host_experts=2, batch_capacity=4, max_len=48, policy="lru"))
    rng = np.random.default_rng(0)

    def batch(n, length):
        return rng.integers(0, cfg.vocab_size, (n, length)).tolist()

    for length in (3, 12):  # warm-up: both prefill chunk sizes (8 and 16)
        engine.generate(batch(4, length), 11)
    live = sum(a.nbytes for a in jax.live_arrays())
    assert compiles.count > 0  # the counter sees compilations at all
    # steps stalled on disk and ran again from a layer, in the programs compiled for them
    assert engine.stats()["resumed_layers"] > 0
    assert (compiles.names["prefill_step"], compiles.names["decode_step"]) == (2, 1)
    compiles.count = 0
    steps = 0
    while steps < 200:  # requests of varied count and length come and go between batches
        n, length = int(rng.integers(1, 5)), int(rng.integers(1, 17))
        out = engine.generate(batch(n, length), 11)
        assert len(out) == n and all(len(o) == 11 for o in out)
        steps += 10
    assert compiles.count == 0
    # every buffer was allocated at start-up; only the last step's small record may differ
    assert sum(a.nbytes for a in jax.live_arrays()) <= live + (64 << 10)
