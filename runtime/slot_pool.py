"""Tier 0: fixed device arrays holding expert weights in slots, and the page table.

All device memory for experts is allocated once, at construction: `permanent` slots for the hot
set plus one staging region for the layer being computed. (The second staging buffer of the
double buffer is the set of copies in flight for the next layer: `transfer.py`.)
Installing an expert is a donated, jitted in-place update, so nothing is allocated after
warm-up. The page table maps (layer, expert) -> permanent slot (-1 = not resident).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.checkpoint import EXPERT_KINDS, numpy_dtype
from strata_jax.pool import ExpertPool, tile_major

ABSENT = -1


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("transposed", "tile"))
def _install(pool: ExpertPool, slot: jax.Array, arrays: ExpertPool,
             transposed: frozenset[str] = frozenset(),
             tile: tuple[int, int] | None = None) -> ExpertPool:
    def put(name, buf, value):
        if buf is None:
            return None
        if name in transposed:
            value = jnp.swapaxes(value, -1, -2)
        if tile and name in EXPERT_KINDS:
            value = tile_major(value, *tile)
        return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), slot, 0)

    return ExpertPool(*(put(n, b, v) for n, b, v in zip(pool._fields, pool, arrays, strict=True)))


@functools.partial(jax.jit, donate_argnums=0)
def _copy(pool: ExpertPool, src: jax.Array, dst: jax.Array) -> ExpertPool:
    def move(buf):
        if buf is None:
            return None
        return jax.lax.dynamic_update_index_in_dim(buf, buf[src], dst, 0)

    return ExpertPool(*(move(b) for b in pool))


class SlotPool:
    """Expert slots on one device: [0, permanent) hot set, then `staging` staging slots.
    Arrays named in `transposed` arrive as the transpose of what their slots hold (host
    dequantization writes them output-major) and are transposed on the device on install.
    With a `tile` (rows, inputs), packed int4 weights are held tile-major (`pool.tile_major`),
    reordered on the device on install."""

    def __init__(
        self,
        specs: Mapping[str, tuple[tuple[int, ...], str]],
        num_layers: int,
        num_experts: int,
        permanent: int,
        staging: int,
        device: jax.Device | None = None,
        transposed: Collection[str] = (),
        tile: tuple[int, int] | None = None,
    ) -> None:
        self.permanent, self.staging = permanent, staging
        self.transposed, self.tile = frozenset(transposed), tile
        self.num_slots = permanent + staging
        self.device = device or jax.devices()[0]
        fields = {
            name: jax.device_put(
                np.zeros((self.num_slots, *self._held_shape(name, shape)), numpy_dtype(dtype)),
                self.device)
            for name, (shape, dtype) in specs.items()
        }
        self.arrays = ExpertPool(**fields)
        self.page_table = np.full((num_layers, num_experts), ABSENT, np.int32)
        self._owner: dict[int, tuple[int, int]] = {}
        self._free = list(range(permanent - 1, -1, -1))

    def _held_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if not self.tile or name not in EXPERT_KINDS:
            return tuple(shape)
        return tile_major(np.empty(shape, np.uint8), *self.tile).shape

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a is not None)

    def staging_slots(self) -> range:
        return range(self.permanent, self.num_slots)

    def slot_of(self, layer: int, expert: int) -> int | None:
        slot = int(self.page_table[layer, expert])
        return None if slot == ABSENT else slot

    def install(self, slot: int, arrays: Mapping[str, object]) -> None:
        """Write one expert's arrays (host or device) into `slot` in place."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside [0, {self.num_slots})")
        values = ExpertPool(**{k: arrays.get(k) for k in ExpertPool._fields if k in arrays})
        self.arrays = _install(self.arrays, np.int32(slot), values, self.transposed, self.tile)

    def admit(self, layer: int, expert: int, arrays: Mapping[str, object]) -> int:
        """Give (layer, expert) a free permanent slot, install it, update the page table."""
        if self.slot_of(layer, expert) is not None:
            raise ValueError(f"layer {layer} expert {expert} is already resident")
        if not self._free:
            raise RuntimeError("no free permanent slot; evict first")
        slot = self._free.pop()
        self.install(slot, arrays)
        self.page_table[layer, expert] = slot
        self._owner[slot] = (layer, expert)
        return slot

    def admit_from(self, layer: int, expert: int, src: int) -> int:
        """Admit (layer, expert) by copying its weights from slot `src` on the device."""
        if self.slot_of(layer, expert) is not None:
            raise ValueError(f"layer {layer} expert {expert} is already resident")
        if not self._free:
            raise RuntimeError("no free permanent slot; evict first")
        slot = self._free.pop()
        self.arrays = _copy(self.arrays, np.int32(src), np.int32(slot))
        self.page_table[layer, expert] = slot
        self._owner[slot] = (layer, expert)
        return slot

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def evict(self, layer: int, expert: int) -> int:
        """Forget (layer, expert); its slot becomes free (contents overwritten later)."""
        slot = self.slot_of(layer, expert)
        if slot is None:
            raise KeyError(f"layer {layer} expert {expert} is not resident")
        self.page_table[layer, expert] = ABSENT
        del self._owner[slot]
        self._free.append(slot)
        return slot

    def resident(self) -> dict[tuple[int, int], int]:
        return {owner: slot for slot, owner in self._owner.items()}
