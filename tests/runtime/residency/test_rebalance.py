"""Routing drift: rebalancing the pinned set brings the tier-0 hit rate back; static does not."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.tools.synth import synthesize
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    path = tmp_path_factory.mktemp("drift") / "tiny"
    synthesize("tiny", path, skew=0.85, seed=3, dtype="float32", progress=False)
    return path


def _window(engine, seed, calls=3):
    """Tier-0 hit rate over `calls` batches of fresh random prompts."""
    rng = np.random.default_rng(seed)
    hits, routed = engine.counters.hits, engine.counters.routed
    for _ in range(calls):
        prompts = rng.integers(0, engine.cfg.vocab_size, (4, 6)).tolist()
        engine.generate(prompts, 8)
    engine.stats()  # the last step's record
    return (engine.counters.hits - hits) / (engine.counters.routed - routed)


def _shift_popularity(engine, seed):
    """Permute every layer's router bias: different experts become hot."""
    rng = np.random.default_rng(seed)
    bias = np.asarray(engine.params["params"]["layers"]["router_bias"])
    shifted = np.stack([b[rng.permutation(b.size)] for b in bias])
    engine.params["params"]["layers"]["router_bias"] = jnp.asarray(shifted, bias.dtype)


def test_rebalancing_recovers_hit_rate_after_drift(skewed):
    config = EngineConfig(resident_experts=8, host_experts=0, batch_capacity=4, max_len=32,
                          policy="static", predictor="none", rebalance_every=2,
                          hysteresis=0.05, heat_decay=0.8)
    with_rebalance = Engine.from_checkpoint(skewed, config)
    static = Engine.from_checkpoint(skewed, config)
    for engine in (with_rebalance, static):
        for seed in range(4):  # warm up: heat builds, hot experts get pinned
            _window(engine, seed)
    before = _window(with_rebalance, 100)
    static_before = _window(static, 100)
    static.config = dataclasses.replace(config, rebalance_every=0)
    for engine in (with_rebalance, static):
        _shift_popularity(engine, 7)
    dropped = _window(static, 200)
    for seed in range(201, 209):
        _window(with_rebalance, seed)
    after = _window(with_rebalance, 300)
    static_after = _window(static, 300)
    print(f"hit rate before {before:.3f}, after rebalancing {after:.3f}; static: before "
          f"{static_before:.3f}, right after the shift {dropped:.3f}, later {static_after:.3f}")
    assert before > 0.5  # 8 of 32 experts pinned on a skewed model
    assert abs(after - before) <= 0.05
    assert static_after < static_before - 0.05
    assert with_rebalance.counters.swaps > 0
    assert static.counters.swaps <= with_rebalance.counters.swaps
