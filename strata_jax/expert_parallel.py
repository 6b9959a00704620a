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
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from strata_jax import step
from strata_jax.pool import ExpertPool

if TYPE_CHECKING:
    from strata_jax.api import Model

AXIS = "expert"
"""The mesh axis the expert slots are sharded over."""


@dataclass(frozen=True)
class Layout:
    """Where each (layer, expert) lies over `devices` devices: its owner e mod n, and its
    slot among the owner's `slots_per_device` slots, l * per_layer + e // n."""

    num_layers: int
    num_experts: int
    devices: int

    @property
    def per_layer(self) -> int:
        """Slots of one layer on each device (the last devices may leave one empty)."""
        return -(-self.num_experts // self.devices)

    @property
    def slots_per_device(self) -> int:
        return self.num_layers * self.per_layer

    def page(self) -> np.ndarray:
        """int32 [devices, L, E]: each device's page table (its own experts' slots, else
        -1)."""
        e = np.arange(self.num_experts)
        local = np.arange(self.num_layers)[:, None] * self.per_layer + e[None, :] // self.devices
        owner = e % self.devices
        page = np.full((self.devices, self.num_layers, self.num_experts), -1, np.int32)
        for d in range(self.devices):
            page[d][:, owner == d] = local[:, owner == d]
        return page

    def source_slots(self) -> np.ndarray:
        """int [devices * slots_per_device]: the one-device resident slot (l * E + e) each
        sharded slot takes, or -1 for an empty one."""
        src = np.full((self.devices, self.slots_per_device), -1, np.int64)
        for d, table in enumerate(self.page()):
            layers, experts = np.nonzero(table >= 0)
            src[d, table[layers, experts]] = layers * self.num_experts + experts
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


def shard(model: Model, devices: Sequence[jax.Device] | int) -> Model:
    """`model` (resident, one device) with its experts over `devices` (or the first that
    many of `jax.devices()`): the pool laid out by `Layout` and sharded over `AXIS`, the page
    tables [n, L, E], the dense params replicated."""
    if isinstance(devices, int):
        if not 1 <= devices <= len(jax.devices()):
            raise ValueError(f"{devices} devices asked for; this process sees "
                             f"{len(jax.devices())} ({jax.default_backend()})")
        devices = jax.devices()[:devices]
    cfg = model.config
    layout = Layout(cfg.num_layers, cfg.num_experts, len(devices))
    mesh = mesh_of(devices)
    src = layout.source_slots()
    resident = np.asarray(model.slot_table).reshape(-1)
    take = np.where(src >= 0, resident[np.maximum(src, 0)], 0)

    def lay_out(a: jax.Array) -> np.ndarray:
        slots = np.asarray(a)[take]
        slots[src < 0] = 0  # the empty slots of devices with one expert fewer per layer
        return slots

    sharded = NamedSharding(mesh, P(AXIS))
    pool = ExpertPool(*(None if a is None else place(lay_out(a), sharded)
                        for a in model.experts))
    return replace(model, params=place(model.params, NamedSharding(mesh, P())), experts=pool,
                   slot_table=place(layout.page(), sharded), mesh=mesh)


def tiers(page: jax.Array) -> step.Tiers:
    """The resident tiers of sharded page tables [n, L, E]."""
    return step.Tiers(page=page, host=None,
                      host_page=place(np.full(page.shape, -1, np.int32), page.sharding))


def _local(tiers_: step.Tiers) -> step.Tiers:
    """A device's own tables inside `shard_map` ([1, L, E] -> [L, E])."""
    return tiers_.replace(page=tiers_.page[0], host_page=tiers_.host_page[0])


def _check(plan: step.StepPlan) -> step.StepPlan:
    if plan.staging:
        raise ValueError("experts over several devices need every expert in a device slot "
                         "(StepPlan.staging 0)")
    return replace(plan, expert_axis=AXIS)


@dataclass(frozen=True)
class Programs:
    """`step.decode`, `step.prefill` and `step.forward` of one mesh: the same signatures,
    with the sharded pool and the [n, L, E] tiers of `shard`."""

    decode: object
    prefill: object
    forward: object


@functools.cache
def programs(mesh: Mesh) -> Programs:
    """The step programs of `mesh`, compiled once per (mesh, shapes)."""
    shard_map = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
    experts, everyone = P(AXIS), P()

    def decode(cfg, plan, params, pool, tiers_, state, resume=None, forced=None):
        body = shard_map(
            lambda params, pool, tiers_, state, resume, forced: step.decode_step(
                cfg, _check(plan), params, pool, _local(tiers_), state, resume, forced),
            in_specs=(everyone, experts, experts, everyone, everyone, everyone),
            out_specs=everyone)
        return body(params, pool, tiers_, state, resume, forced)

    def prefill(cfg, plan, params, pool, tiers_, state, row, tokens, start, count,
                sampling=None, resume=None, forced=None):
        body = shard_map(
            lambda params, pool, tiers_, state, args, resume, forced: step.prefill_step(
                cfg, _check(plan), params, pool, _local(tiers_), state, *args,
                resume=resume, forced=forced),
            in_specs=(everyone, experts, experts, everyone, everyone, everyone, everyone),
            out_specs=everyone)
        return body(params, pool, tiers_, state, (row, tokens, start, count, sampling),
                    resume, forced)

    def forward(cfg, plan, params, pool, tiers_, tokens):
        body = shard_map(
            lambda params, pool, tiers_, tokens: step.forward_pass(
                cfg, _check(plan), params, pool, _local(tiers_), tokens),
            in_specs=(everyone, experts, experts, everyone), out_specs=everyone)
        return body(params, pool, tiers_, tokens)

    jit = functools.partial(jax.jit, static_argnames=("cfg", "plan"),
                            compiler_options=step.COMPILER_OPTIONS)
    return Programs(decode=jit(decode, donate_argnames=("state",)),
                    prefill=jit(prefill, donate_argnames=("state",)),
                    forward=jit(forward))
