"""The rates of a built engine's own kernels, which the cost model's measured profile reads
(docs/design.md, "The cost model"; `strata_runtime.lab.bench` module docstring).

After the engine's warm-up: its expert kernel on its pool applying a layer's worth of routed
experts (`expert_kernel_gbps`), its decode step without its experts (`dense_kernel_gbps`) and the
step's own copy of a layer's misses out of its tier 1 (`step_link`). Each reads the engine
through `EngineFacts`. The machine's ceilings, measured apart from any engine, are
`strata_runtime.lab.ceilings`'.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.formats.config import ModelConfig
from strata_jax.model.decoder import (
    cached_attention,
    copy_in,
    dense_mlp,
    lm_head,
    route_layer,
    with_shared,
)
from strata_jax.ops.expert_kernels import grouped_swiglu
from strata_jax.ops.layers import rms_norm
from strata_jax.ops.pool import ExpertPool
from strata_runtime.engine.stats import PhaseCounts
from strata_runtime.lab.ceilings import CHAIN, best_seconds, chained_seconds
from strata_runtime.lab.cost_model import HardwareProfile
from strata_runtime.lab.counting import dense_bytes
from strata_runtime.lab.facts import EngineFacts


def expert_kernel_gbps(pool: ExpertPool, hidden: int, dtype, rows: int, experts: int,
                       int4_tiles=None, reps: int = 20, chain: int = CHAIN) -> float:
    """GB/s of expert bytes the engine's expert kernel (`expert_kernels.grouped_swiglu`, the
    path it picks for `rows` rows and the pool's format) reads applying `experts` slots of
    `pool` to `rows` rows (a layer's worth of experts, as a decode step reads them): `chain`
    layers' worth in one program, each on the last one's output, best wall time of `reps`."""
    experts = max(1, min(experts, pool.num_slots))
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((rows, hidden)),
                                   dtype), pool.w1.sharding)
    slots = jax.device_put(jnp.arange(experts, dtype=jnp.int32), pool.w1.sharding)

    def experts_of(x, slots, pool):  # the kernel alone; tanh keeps the chained rows bounded
        return jnp.tanh(grouped_swiglu(x, slots, pool, None, int4_tiles).sum((0, 1))
                        ).astype(x.dtype)

    per_slot = sum(a.nbytes for a in pool if a is not None) / pool.num_slots
    return experts * per_slot / chained_seconds(experts_of, x, (slots, pool), chain, reps) / 1e9


def _step_without_experts(cfg: ModelConfig, positions: jax.Array, unroll: bool):
    """The decode step's dense work, made of the model's own functions (`model.decoder`): the
    dense-MLP layers (`ModelConfig.dense_layers`: attention and MLP), then each MoE layer's
    attention over the cache, routing and shared expert, the layers scanned, then the lm head.
    The model's layer (`flax_model.DecoderLayer`, `decoder.tiered_moe`) always serves the
    routed experts, so the composition is restated here without them."""
    def mlp_layer(carry, xs):
        x, k_all, v_all = carry
        lp, li = xs
        x, k_all, v_all = cached_attention(cfg, lp, x, positions, k_all, v_all, li, None)
        return (dense_mlp(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_eps), x), k_all, v_all), None

    def layer(carry, xs):
        x, k_all, v_all = carry
        lp, li = xs
        x, k_all, v_all = cached_attention(cfg, lp, x, positions, k_all, v_all, li, None)
        h, routing = route_layer(cfg, lp, x)
        x = x + with_shared(cfg, lp, h, jnp.zeros_like(h)).reshape(x.shape)
        return (x, k_all, v_all), routing.experts

    def step(x, k_all, v_all, p):
        if cfg.dense_layers:
            (x, k_all, v_all), _ = jax.lax.scan(
                mlp_layer, (x, k_all, v_all), (p["mlp_layers"], jnp.arange(cfg.dense_layers)),
                unroll=unroll)
        (x, k_all, v_all), experts = jax.lax.scan(
            layer, (x, k_all, v_all), (p["layers"], jnp.arange(cfg.num_layers) + cfg.dense_layers),
            unroll=unroll)
        return lm_head(cfg, p, x), experts, k_all, v_all

    return step


def dense_kernel_gbps(cfg: ModelConfig, params: dict[str, Any], rows: int, cache_len: int,
                      unroll: bool, reps: int = 20) -> float:
    """GB/s of dense bytes (the params but the embedding table, as `counting.Sizes` counts
    them) that the model's decode step reads without its experts, at `rows` rows of one token:
    every layer's attention over a cache of `cache_len` positions (`model.cached_attention`,
    the cache updated in place as the step's is), its routing and its shared expert, the layers
    scanned as the step scans them (`unroll`: the step plan's; a rolled scan copies each
    layer's weights out of the stacks first), then the lm head, in one program; best wall
    time of `reps`. The step's dense matmuls, its attention and its routing, many small
    kernels among them, run at this rate, not at a plain read's (docs/design.md, "The cost
    model"). The rows are the embeddings of `rows` seeded token ids at position 0. It holds a
    cache of the engine's size beside the engine's own while it runs (outside the ledger, freed
    on return): where the device lacks the room, `kernel_rates` falls back to the device
    read."""
    p = params["params"]
    dev = next(iter(p["final_norm"].devices()))
    ids = np.random.default_rng(0).integers(cfg.vocab_size, size=rows)
    x = jax.device_put(p["embed"][ids][:, None], dev)
    positions = jax.device_put(jnp.zeros((rows, 1), jnp.int32), dev)
    cache = [jnp.zeros(shape, cfg.dtype, device=dev) for shape in cfg.cache_shapes(rows,
                                                                                 cache_len)]
    run = jax.jit(_step_without_experts(cfg, positions, unroll), donate_argnums=(1, 2))

    def call():
        logits, experts, *cache[:] = run(x, *cache, p)
        return logits, experts

    return dense_bytes(cfg, params) / best_seconds(lambda: jax.block_until_ready(call()),
                                                   reps) / 1e9


def step_link(host: ExpertPool | None, decode: PhaseCounts, layers: int, devices: int,
              reps: int = 3) -> dict[str, Any] | None:
    """The link as an engine's decode steps use it (None when they copied nothing, or it has
    no tier 1 `host`): GB/s of as many experts as a decode step's layer copied in the `decode`
    counters so far (the warm-up's; over `devices` devices each copies its share), copied out
    of `host` by the step's own copy (`copy_in_gbps`), best of `reps`. Copies made apart
    (`residency.link.link_rate`) may run faster than the step's, and a layer's few copies below the
    rate of many (docs/design.md, "Benchmarks and sweeps")."""
    copies = decode.fetched + decode.prefetched
    if host is None or not decode.calls or not copies:
        return None
    per_link = copies / decode.calls / layers / devices  # the devices copy side by side
    count = int(np.clip(round(per_link), 1, host.w1.shape[0]))
    gbps = copy_in_gbps(host, count, reps)
    return {"gbps": gbps, "copy_bytes": slot_bytes(host), "copies": count}


def copy_in_gbps(host: ExpertPool, count: int, reps: int = 3) -> float:
    """GB/s of `count` experts of the pinned-host pool `host` copied into device memory the way
    a step copies a layer's misses (`model.copy_in`: a dynamic slice of the pinned-host arrays
    into `device_put`, one expert after another, in one program), from slots spread over the
    pool; the best of `reps` calls after a compiling one."""
    dev = next(iter(host.w1.devices()))
    slots = host.w1.shape[0]
    scratch = ExpertPool(*(None if a is None else
                           jnp.zeros((count, *a.shape[1:]), a.dtype, device=dev) for a in host))
    ids = jax.device_put(np.linspace(0, slots - 1, count).astype(np.int32), dev)
    run = jax.jit(lambda pool, pinned, src: copy_in(pool, pinned, src, 0, count),
                  donate_argnums=0)
    scratch = jax.block_until_ready(run(scratch, host, ids))
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        scratch = jax.block_until_ready(run(scratch, host, ids))
        best = min(best, time.perf_counter() - t0)
    return count * slot_bytes(host) / max(best, 1e-9) / 1e9


def slot_bytes(pool: ExpertPool) -> int:
    """Bytes of one slot of `pool` (every array's)."""
    return sum(a.nbytes // a.shape[0] for a in pool if a is not None)


def layer_experts(facts: EngineFacts) -> int:
    """Experts a layer of the engine's decode steps routed so far (the warm-up's), rounded;
    without a decode step, as many as its rows can route."""
    cfg, rows, d = facts.cfg, facts.sizes.rows, facts.counters().decode
    return (round(d.routed / d.calls / cfg.num_layers) if d.calls
            else min(cfg.num_experts, cfg.top_k * rows))


def kernel_rates(facts: EngineFacts,
                 hw: HardwareProfile) -> tuple[HardwareProfile, int, dict[str, str]]:
    """`hw` with the rates of the engine's own kernels at its decode rows, once its warm-up has
    run: the expert kernel on its pool (`expert_kernel_gbps`) applying as many experts as a
    layer of the warm-up's decode steps routed (`layer_experts`: a kernel's fixed costs weigh
    more on fewer experts), and the step without its experts (`dense_kernel_gbps`); a rate that
    cannot be measured stays the device read's, its error returned by name. Returns (hw, the
    expert count, the errors)."""
    cfg, rows, experts = facts.cfg, facts.sizes.rows, layer_experts(facts)
    measure = {
        "expert_read_gbps": lambda: expert_kernel_gbps(
            facts.pool(), cfg.hidden_size, cfg.dtype, rows, experts, facts.config.int4_tiles),
        "dense_read_gbps": lambda: dense_kernel_gbps(cfg, facts.params, rows, facts.cache_len,
                                                     facts.unroll)}
    errors: dict[str, str] = {}
    for name, rate in measure.items():
        try:
            hw = dataclasses.replace(hw, **{name: rate()})
        except Exception as e:  # noqa: BLE001  (the prediction falls back to the HBM rate)
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"warning: {name} not measured ({errors[name]}): the prediction reads at "
                  "the device read rate instead", file=sys.stderr)
    return hw, experts, errors


def engine_step_link(facts: EngineFacts) -> dict[str, Any] | None:
    """`step_link` of the engine's first device's tier 1 and its decode steps so far."""
    return step_link(facts.host(), facts.counters().decode, facts.cfg.num_layers, facts.devices)
