"""Experts over the devices of a mesh (docs/design.md, "Experts over several devices").

Each device of a one-axis mesh (`AXIS`) holds the slots of its own experts: expert e of every
layer lives on device e mod n, so each device's slots hold the same number of experts of
each layer and the routing's hot experts spread over all of them. Tokens, the dense params
and the KV cache are replicated. The step runs under `shard_map`: every device runs the whole
step on the same input; in each layer it computes the picks of its own experts (its page
table marks the others -1) and a `psum` over the axis joins them. Every pick is computed on
exactly one device and is exactly zero on the others, so the sum is that pick bit for bit:
the tokens and logits are those of one device.

`shard(model, devices)` gives a `Model` whose pool is laid out and placed so; the generate,
logits and routing functions of `strata_jax.api` then run the programs of `programs(mesh)`.
Budgets over a mesh (each device's slots, staging halves and share of a pinned-host tier,
its own misses over its own link) are the offload engine's: `EngineConfig.expert_devices`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from strata_jax.step import programs as step

AXIS = "expert"
"""The mesh axis the expert slots are sharded over."""


def owners(num_layers: int, num_experts: int, devices: int,
           heat: np.ndarray | None = None) -> np.ndarray:
    """int32 [L, E]: the device that owns each expert. Every device owns an equal count of
    each layer's experts (the first ones dealt one more where they do not divide evenly):
    without `heat`, expert e is device e mod n's; with routing heat [L, E], each layer's
    experts are dealt hottest first in snake order (0, 1, .., n-1, n-1, .., 0, 0, ..; a short
    last round from device 0), so every device's share of the routing, and so of its misses,
    is alike: no two apart by more than the layer's hottest expert."""
    if heat is None:
        row = np.arange(num_experts, dtype=np.int32) % devices
        return np.broadcast_to(row, (num_layers, num_experts)).copy()
    rounds = np.arange(num_experts) // devices
    turn = np.arange(num_experts) % devices
    forward = (rounds % 2 == 0) | (rounds == num_experts // devices)  # a short last round too
    snake = np.where(forward, turn, devices - 1 - turn).astype(np.int32)
    owner = np.empty((num_layers, num_experts), np.int32)
    for layer in range(num_layers):
        owner[layer, np.argsort(-np.asarray(heat[layer]), kind="stable")] = snake
    return owner


@dataclass(frozen=True)
class Layout:
    """Where each (layer, expert) lies over `devices` devices: on its owner (`owner` [L, E],
    default `owners`: device e mod n), the j-th expert of a layer that a device owns (by id)
    takes one of its device slots if j < `resident` (slot l * resident + j), else one of its
    pinned-host slots (slot l * (per_layer - resident) + j - resident). `resident` None:
    every expert in a device slot."""

    num_layers: int
    num_experts: int
    devices: int
    resident: int | None = None
    owner: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.owner is None:
            object.__setattr__(self, "owner", owners(self.num_layers, self.num_experts,
                                                     self.devices))
        if self.resident is not None and not 0 <= self.resident <= self.per_layer:
            raise ValueError(f"resident experts per layer and device must be in [0, "
                             f"{self.per_layer}], got {self.resident}")

    @property
    def per_layer(self) -> int:
        """Experts of one layer each device owns (the last devices may own one fewer)."""
        return -(-self.num_experts // self.devices)

    @property
    def device_slots(self) -> int:
        """Device slots per device for the experts (staging comes after them)."""
        return self.num_layers * (self.per_layer if self.resident is None else self.resident)

    @property
    def host_slots(self) -> int:
        """Pinned-host slots per device."""
        return self.num_layers * self.per_layer - self.device_slots

    def pages(self) -> tuple[np.ndarray, np.ndarray]:
        """int32 [devices, L, E] each: every device's page table (its experts' device slots)
        and host page table (their pinned-host slots); -1 elsewhere."""
        shape = (self.devices, self.num_layers, self.num_experts)
        page, host = np.full(shape, -1, np.int32), np.full(shape, -1, np.int32)
        r = self.per_layer if self.resident is None else self.resident
        for d in range(self.devices):
            for layer in range(self.num_layers):
                for j, e in enumerate(np.nonzero(self.owner[layer] == d)[0]):
                    if j < r:
                        page[d, layer, e] = layer * r + j
                    else:
                        host[d, layer, e] = layer * (self.per_layer - r) + j - r
        return page, host


def sources(table: np.ndarray, slots: int) -> np.ndarray:
    """int [devices * slots]: the one-device resident slot (l * E + e) each slot of the
    tables `table` [devices, L, E] takes, or -1 for a slot that holds none."""
    devices, _, num_experts = table.shape
    src = np.full((devices, slots), -1, np.int64)
    for d in range(devices):
        layers, experts = np.nonzero(table[d] >= 0)
        src[d, table[d][layers, experts]] = layers * num_experts + experts
    return src.reshape(-1)


def mesh_of(devices: Sequence[jax.Device]) -> Mesh:
    """A one-axis mesh (`AXIS`) over `devices`."""
    return Mesh(np.asarray(devices), (AXIS,))


def place(tree, sharding: NamedSharding):
    """Every array of `tree` as a global array of `sharding`, built from its host copy: each
    process gives its own devices their pieces (several processes hold the same values: a
    model loaded, or made from the same seed, by each), so nothing crosses between hosts."""
    def one(a):
        host = np.asarray(a)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree)


def tiers(page: jax.Array) -> step.Tiers:
    """The resident tiers of sharded page tables [n, L, E] (experts owned as `owners`)."""
    n, num_layers, num_experts = page.shape
    everyone = NamedSharding(page.sharding.mesh, P())
    return step.Tiers(page=page, host=None,
                      host_page=place(np.full(page.shape, -1, np.int32), page.sharding),
                      owner=place(owners(num_layers, num_experts, n), everyone))


def _local(tiers_: step.Tiers) -> step.Tiers:
    """A device's own tables inside `shard_map` ([1, L, E] -> [L, E]; the owner table is
    every device's)."""
    return tiers_.replace(page=tiers_.page[0], host_page=tiers_.host_page[0])


def _tier_specs(experts: P, everyone: P) -> step.Tiers:
    """How `shard_map` splits the tiers: the page tables and tier 1 over the axis, the
    owner table whole on every device."""
    return step.Tiers(page=experts, host=experts, host_page=experts, owner=everyone)


def _sharded(plan: step.StepPlan) -> step.StepPlan:
    return replace(plan, expert_axis=AXIS)


def _own_counters(record: step.StepRecord) -> dict[str, jax.Array]:
    """Inside `shard_map`: every device's `step.PER_DEVICE` counters, [L] -> [L, n], gathered
    over the axis so that the whole record is replicated: each process of several reads it
    from its own devices (a piece per device would leave every process only its own)."""
    return {k: jax.lax.all_gather(getattr(record, k), AXIS, axis=1) for k in step.PER_DEVICE}


def _with_counters(out, counters: dict[str, jax.Array]):
    """`out` (a StepOutput, or a StepRecord) with the counters of every device, [L, n]."""
    if isinstance(out, step.StepRecord):
        return out.replace(**counters)
    return out.replace(record=out.record.replace(**counters))


@functools.cache
def programs(mesh: Mesh, staged: bool = False) -> step.Programs:
    """`step.PROGRAMS[staged]` of `mesh` (the same signatures, with the sharded pool and the
    [n, L, E] tiers of `loaded.shard` or the offload engine), compiled once per (mesh, shapes).
    Their records carry the `step.PER_DEVICE` counters of each device, [L, n]; the whole
    record is replicated."""
    shard_map = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
    experts, everyone = P(AXIS), P()
    tiers_spec = _tier_specs(experts, everyone)

    def decode(cfg, plan, params, pool, tiers_, state, resume=None, forced=None):
        def local(params, pool, tiers_, state, resume, forced):
            state, out, pool = step.decode_step(cfg, _sharded(plan), params, pool,
                                                _local(tiers_), state, resume, forced)
            return state, out, pool, _own_counters(out.record)

        state, out, pool, counters = shard_map(
            local, in_specs=(everyone, experts, tiers_spec, everyone, everyone, everyone),
            out_specs=(everyone, everyone, experts, everyone),
        )(params, pool, tiers_, state, resume, forced)
        return state, _with_counters(out, counters), pool

    def prefill(cfg, plan, params, pool, tiers_, state, rows, tokens, starts, counts,
                sampling=None, riders=None, targets=None, resume=None, forced=None):
        def local(params, pool, tiers_, state, args, resume, forced):
            state, out, pool = step.prefill_step(cfg, _sharded(plan), params, pool,
                                                 _local(tiers_), state, *args, resume=resume,
                                                 forced=forced)
            return state, out, pool, _own_counters(out.record)

        state, out, pool, counters = shard_map(
            local, in_specs=(everyone, experts, tiers_spec, everyone, everyone, everyone, everyone),
            out_specs=(everyone, everyone, experts, everyone),
        )(params, pool, tiers_, state, (rows, tokens, starts, counts, sampling, riders, targets),
          resume, forced)
        return state, _with_counters(out, counters), pool

    def forward(cfg, plan, params, pool, tiers_, tokens):
        def local(params, pool, tiers_, tokens):
            logits, record = step.forward_pass(cfg, _sharded(plan), params, pool,
                                               _local(tiers_), tokens)
            return logits, record, _own_counters(record)

        logits, record, counters = shard_map(
            local, in_specs=(everyone, experts, tiers_spec, everyone),
            out_specs=(everyone, everyone, everyone))(params, pool, tiers_, tokens)
        return logits, _with_counters(record, counters)

    jit = functools.partial(jax.jit, static_argnames=("cfg", "plan"),
                            compiler_options=step.COMPILER_OPTIONS)
    donated = ("state", "pool") if staged else ("state",)
    return step.Programs(decode=jit(decode, donate_argnames=donated),
                         prefill=jit(prefill, donate_argnames=donated), forward=jit(forward))
