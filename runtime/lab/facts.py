"""What the lab reads of a built engine, read in one place (`EngineFacts.of`): the rest of the lab
(`bench`, `kernel_rates`) reads these facts, never the engine's attributes, so a change of the
engine's attributes takes one edit here. Besides them the lab calls only the engine's public
methods (`generate`, `stats`, `reset_stats`, its context manager).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from strata_jax.formats.config import ModelConfig
from strata_jax.model.misses import MissRates
from strata_jax.ops.pool import ExpertPool
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.engine.stats import EngineStats
from strata_runtime.lab.cost_model import model_cost
from strata_runtime.lab.counting import Sizes, dense_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineFacts:
    """A built engine as the lab sees it: its model and knobs, its arrays' sizes, its tiers, the
    rates it measured at start-up, and a reader of its live counters."""

    cfg: ModelConfig
    """The model's shape (`Engine.cfg`)."""
    config: EngineConfig
    """The knobs it was built with (`Engine.config`)."""
    params: dict[str, Any]
    """Its dense params as it placed them (`Engine.params`)."""
    sizes: Sizes
    """Bytes and FLOPs of its model as its slots and state hold them: bytes per expert
    (`EngineStats.bytes_per_expert`), dense bytes of `params`, the KV cache's bytes
    (`Engine.state.k`, `.v`), its rows (`Engine.capacity`)."""
    cache_len: int
    """Positions of its KV cache (`Engine.state.max_len`)."""
    unroll: bool
    """Whether its step unrolls the layer scan (`Engine.plan.unroll`)."""
    prefill_chunk: int
    """Tokens per prefill chunk (`Engine.prefill_chunk`)."""
    devices: int
    """Devices of its expert axis (`Engine.layout.devices`); their links copy side by side."""
    pool: Callable[[], ExpertPool]
    """The first device's slots, tier 0 and staging, as they are now
    (`Engine.shares[0].residency.pool`: a step replaces its arrays, donating the old ones)."""
    host: Callable[[], ExpertPool | None]
    """The first device's pinned-host tier 1 as it is now (`Engine.shares[0].residency.host`);
    None when every expert has an HBM slot (`Engine.layout.resident`)."""
    host_rates: MissRates | None
    """The host expert kernel's and the link's rates it decides misses by (measured at
    start-up unless configured); None: misses are only copied (`Engine.host_misses`)."""
    startup: dict[str, float]
    """Seconds of each start-up phase (`Engine.startup`)."""
    counters: Callable[[], EngineStats]
    """Its live counters (`Engine.counters`; `Engine.reset_stats` replaces them: call this
    again after one)."""

    @classmethod
    def of(cls, engine: Engine) -> EngineFacts:
        """The facts of `engine`, once it is built: every engine attribute the lab reads."""
        cfg = engine.cfg
        return cls(
            cfg=cfg, config=engine.config, params=engine.params,
            sizes=Sizes(bytes_per_expert=int(engine.counters.bytes_per_expert),
                        dense_bytes=dense_bytes(cfg, engine.params),
                        kv_bytes=int(engine.state.k.nbytes + engine.state.v.nbytes),
                        rows=engine.capacity, flops_per_token=model_cost(cfg).flops_per_token),
            cache_len=engine.state.max_len, unroll=engine.plan.unroll,
            prefill_chunk=engine.prefill_chunk, devices=len(engine.layout.devices),
            pool=lambda: engine.shares[0].residency.pool,
            host=lambda: None if engine.layout.resident else engine.shares[0].residency.host,
            host_rates=None if engine.host_misses is None else engine.host_misses.rates,
            startup=dict(engine.startup), counters=lambda: engine.counters)
