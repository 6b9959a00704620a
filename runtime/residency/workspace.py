"""The ledger's workspace line: the temporary HBM the compiled step programs themselves need.

docs/design.md, "The ledger". XLA reports, for a compiled program, the scratch it allocates
besides its arguments and outputs (`memory_analysis().temp_size_in_bytes`): activations,
logits, the sampler's sort, the expert kernels' buffers. The step's programs are compiled
ahead of time here on abstract arguments (nothing is read or allocated) at the layout the
ledger proposes: the two decode programs (greedy and sampled) and the prefill chunk.
The pool and tiers are arguments, not scratch, so a pool of a few slots gives the same figure.
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax import api
from strata_jax.formats.checkpoint import CheckpointReader, expert_arrays
from strata_jax.formats.config import ModelConfig
from strata_jax.ops.pool import ExpertPool
from strata_jax.step import programs as step
from strata_jax.step.sampling import GREEDY, row_values, stack_values
from strata_runtime.residency.tiers import as_held


def held_expert_shapes(reader: CheckpointReader, host_dequant: bool,
                       tile: tuple[int, int] | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of one expert's arrays as the pools hold them."""
    cfg = reader.config
    specs = expert_arrays(cfg.replace(dtype="bfloat16")) if host_dequant else reader.expert_specs
    held = as_held({n: np.zeros(shape, jnp.dtype(dtype)) for n, (shape, dtype) in specs.items()},
                   tile)
    return {n: (a.shape, a.dtype.name) for n, a in held.items()}


def _pool(shapes, slots: int, device: jax.Device, memory_kind: str) -> ExpertPool:
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
    return ExpertPool(**{n: jax.ShapeDtypeStruct((slots, *shape), jnp.dtype(dtype),
                                                 sharding=sharding)
                         for n, (shape, dtype) in shapes.items()})


def compiled_workspace(reader: CheckpointReader, plan: step.StepPlan, *, batch: int,
                       max_len: int, shapes, chunk: int, device: jax.Device | None = None) -> int:
    """Bytes of scratch of the largest of the decode (greedy, sampled) and `chunk`-token
    prefill programs of `plan` at (batch, max_len), compiled for `device` (default: this
    process's first). Remembered per process and program: engines of one layout compile it
    once, and a ledger that tries a shorter chunk compiles only the prefill again."""
    layout = _layout(reader, plan, batch, max_len, shapes, device)
    with ThreadPoolExecutor(2) as threads:  # XLA compiles without holding the GIL
        parts = threads.map(lambda c: _measure(*layout, c), (0, chunk))
        return max(parts)


def lowered_programs(reader: CheckpointReader, plan: step.StepPlan, *, batch: int,
                     max_len: int, shapes, chunk: int, device: jax.Device | None = None
                     ) -> list[jax.stages.Lowered]:
    """The programs `compiled_workspace` compiles, lowered on abstract arguments."""
    layout = _layout(reader, plan, batch, max_len, shapes, device)
    return _lowered(*layout, 0) + _lowered(*layout, chunk)


def _layout(reader: CheckpointReader, plan: step.StepPlan, batch: int, max_len: int, shapes,
            device: jax.Device | None) -> tuple:
    """The hashable arguments of `_measure` and `_lowered`."""
    dense = "int8" if reader.quantization["dense"] != "none" else "none"
    key = tuple(sorted((n, tuple(shape), dtype) for n, (shape, dtype) in shapes.items()))
    return reader.config, dense, plan, batch, max_len, key, device or jax.local_devices()[0]


@functools.lru_cache(maxsize=64)
def _measure(cfg: ModelConfig, dense: str, plan: step.StepPlan, batch: int, max_len: int,
             shapes: tuple, device: jax.Device, chunk: int) -> int:
    """The largest scratch of the programs `_lowered` gives (chunk 0: the decode programs)."""
    lowered = _lowered(cfg, dense, plan, batch, max_len, shapes, device, chunk)
    with ThreadPoolExecutor(len(lowered)) as threads:
        compiled = list(threads.map(lambda lo: lo.compile(), lowered))
    return max(int(c.memory_analysis().temp_size_in_bytes) for c in compiled)


def _lowered(cfg: ModelConfig, dense: str, plan: step.StepPlan, batch: int, max_len: int,
             shapes: tuple, device: jax.Device, chunk: int) -> list[jax.stages.Lowered]:
    """The two decode programs (greedy and sampled) for chunk 0, else the `chunk`-token
    prefill program, lowered on abstract arguments."""
    shapes = {n: (shape, dtype) for n, shape, dtype in shapes}
    params = jax.eval_shape(lambda: api.init_params(cfg, jax.random.key(0), dense))
    slots = max(1, 2 * plan.staging + 1)
    pool = _pool(shapes, slots, device, "device")
    page = jax.ShapeDtypeStruct((cfg.num_layers, cfg.num_experts), jnp.int32)
    # two host slots: XLA turns a slice of a one-slot pinned-host array into a bitcast across
    # memory spaces, which the GPU compiler rejects
    host = _pool(shapes, 2, device, "pinned_host") if plan.staging else None
    tiers = step.Tiers(page=page, host=host, host_page=page)
    state = jax.eval_shape(lambda: step.init_state(cfg, batch, max_len, device))
    if chunk == 0:
        decode = step.PROGRAMS[plan.staging > 0].decode
        return [decode.lower(cfg, p, params, pool, tiers, state)
                for p in (plan, dataclasses.replace(plan, sample=True))]
    prefill = step.PROGRAMS[plan.staging > 0].prefill
    tokens = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
    one = jax.ShapeDtypeStruct((1,), jnp.int32)
    values = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype),
                          stack_values([row_values(GREEDY)]))
    riders = jax.ShapeDtypeStruct((batch,), jnp.bool_)
    return [prefill.lower(cfg, plan, params, pool, tiers, state, one, tokens, one, one,
                          values, riders)]
