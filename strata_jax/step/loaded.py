"""A model loaded to stay resident: its dense params, a pool holding every expert, its slot
table, and the step programs it runs (one device, or its experts over a mesh:
`expert_parallel`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from strata_jax.formats.config import ModelConfig
from strata_jax.model.moe import ExpertPool
from strata_jax.step import expert_parallel
from strata_jax.step import programs as step
from strata_jax.step.expert_parallel import AXIS, Layout, mesh_of, place, sources


def programs_for(mesh: jax.sharding.Mesh | None, staged: bool) -> step.Programs:
    """The step programs of one device (None) or of experts over `mesh`, staged (the pool
    donated, its staging halves written in place) or not: the table every engine takes its
    programs from."""
    return step.PROGRAMS[staged] if mesh is None else expert_parallel.programs(mesh, staged)


@dataclass(frozen=True)
class Model:
    """A resident model: the dense param tree (`dense_params`), an expert pool holding every
    expert, its slot table."""

    config: ModelConfig
    params: dict[str, Any]
    experts: ExpertPool
    slot_table: jax.Array
    tokenizer: Any = None  # the checkpoint's strata_jax.formats.tokenizer.Tokenizer, if it has one
    mesh: jax.sharding.Mesh | None = None
    """Experts over this mesh's devices (`shard`; `slot_table` is then each
    device's page table, [n, L, E]); None: one device."""

    def programs(self) -> tuple[Any, Any, Any, step.Tiers]:
        """(decode, prefill, forward, tiers): the step programs this model runs."""
        table = programs_for(self.mesh, staged=False)
        tiers = (step.resident_tiers(self.slot_table) if self.mesh is None
                 else expert_parallel.tiers(self.slot_table))
        return table.decode, table.prefill, table.forward, tiers

    def init_state(self, batch: int, max_len: int) -> step.DecodeState:
        """An empty decode state where this model's programs take it."""
        if self.mesh is None:
            return step.init_state(self.config, batch, max_len)
        state = step.init_state(self.config, batch, max_len, jax.local_devices()[0])
        return place(state, NamedSharding(self.mesh, P()))


def shard(model: Model, devices: Sequence[jax.Device] | int) -> Model:
    """`model` (resident, one device) with its experts over `devices` (or the first that
    many of `jax.devices()`): the pool laid out by `Layout` and sharded over `AXIS`, the page
    tables [n, L, E], the dense params replicated."""
    table = np.asarray(model.slot_table)  # [L, E] -> each expert's resident slot
    experts = {k: np.asarray(a)[table] for k, a in model.experts._asdict().items()
               if a is not None}
    return from_host(model.config, model.params, experts, devices, model.tokenizer)


def from_host(config, params, experts: dict[str, np.ndarray], devices, tokenizer=None
              ) -> Model:
    """A resident `Model` over `devices` straight from host arrays (experts [L, E, ...] per
    kind, as a checkpoint reads them): no device ever holds more than its own experts."""
    devices = _devices(devices)
    layout = Layout(config.num_layers, config.num_experts, len(devices))
    mesh = mesh_of(devices)
    page, _ = layout.pages()
    src = sources(page, layout.device_slots)
    sharded = NamedSharding(mesh, P(AXIS))
    pool = ExpertPool(**{k: _pieces(v.reshape(-1, *v.shape[2:]), np.maximum(src, 0), src < 0,
                                    sharded) for k, v in experts.items()})
    return Model(config, place(params, NamedSharding(mesh, P())), pool, place(page, sharded),
                 tokenizer, mesh)


def _devices(devices: Sequence[jax.Device] | int) -> Sequence[jax.Device]:
    if isinstance(devices, int):
        if not 1 <= devices <= len(jax.devices()):
            raise ValueError(f"expert_devices={devices} (--expert-devices): this process "
                             f"sees {len(jax.devices())} {jax.default_backend()} device(s)")
        return jax.devices()[:devices]
    return devices


def _pieces(flat: np.ndarray, take: np.ndarray, empty: np.ndarray,
            sharding: NamedSharding) -> jax.Array:
    """The global array whose slot i is `flat[take[i]]` (zeros where `empty`): each device
    receives only its own slots, gathered on the host."""
    def piece(index: tuple[slice, ...]) -> np.ndarray:
        rows = np.arange(len(take))[index[0]]
        out = flat[take[rows]]
        out[empty[rows]] = 0  # staging, and the slots of devices that own one expert fewer
        return out

    return jax.make_array_from_callback((len(take), *flat.shape[1:]), sharding, piece)
