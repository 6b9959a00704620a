"""Where every expert lies, and the only code that moves one between tiers between steps.

docs/design.md, "Tiers". Tier 0 is one device `ExpertPool` allocated once: the pinned (hot)
slots, the cache slots, then the two staging halves the step writes its copies into. Tier 1
is one stacked `ExpertPool` in `pinned_host` memory, which the step slices by a device page
table (`host_page`). Tier 2 is the checkpoint on disk. The host changes residency only between
steps, by donated in-place updates (nothing is allocated after start-up), and keeps the page
tables the step reads: `tiers()` uploads them when they changed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from strata_jax.formats.checkpoint import EXPERT_KINDS
from strata_jax.ops.pool import ExpertPool, free, host_view, tile_major
from strata_jax.step.expert_parallel import AXIS, place
from strata_jax.step.programs import Tiers

Key = tuple[int, int]  # (layer, expert)
Arrays = dict[str, np.ndarray]


@functools.partial(jax.jit, donate_argnums=0)
def _pull(pool: ExpertPool, slot, host: ExpertPool, host_slot) -> ExpertPool:
    """Copy host slot `host_slot` into pool slot `slot` (the step's own copy mechanism)."""
    def one(buf, src):
        if buf is None:
            return None
        piece = jax.device_put(src[host_slot], jax.memory.Space.Device)
        return jax.lax.dynamic_update_index_in_dim(buf, piece, slot, 0)

    return ExpertPool(*(one(b, s) for b, s in zip(pool, host, strict=True)))


class Residency:
    """The tier-0 pool and the tier-1 host pool with their page tables.

    `load(key)` reads one expert from disk as the pools hold it (numpy, already dequantized
    or tile-major if the pools are); it raises `CheckpointError` for a corrupt chunk."""

    def __init__(self, num_layers: int, num_experts: int, device: jax.Device,
                 load: Callable[[Key], Arrays], device_keys: Sequence[Key],
                 device_slots: int, staging: int, host_keys: Sequence[Key] | None,
                 host_slots: int, read: Callable[[Callable, Sequence[Key]], list] | None = None):
        """`device_keys` fill the first device slots (the rest of `device_slots` start empty:
        cache slots); `staging` experts per staging half follow. `host_keys` fill the host
        pool of `host_slots` slots (None: no host tier, every expert has a device slot).
        `read` maps `load` over keys (e.g. on NUMA-bound threads)."""
        read = read or (lambda fn, keys: [fn(k) for k in keys])
        self.device = device
        self.shape = (num_layers, num_experts)
        self.staging = staging
        self.page = np.full(self.shape, -1, np.int32)
        self.host_page = np.full(self.shape, -1, np.int32)
        self.slot_key: list[Key | None] = [None] * device_slots
        self.host_key: list[Key | None] = [None] * host_slots
        self.broken: dict[Key, str] = {}  # experts whose chunk failed to read
        self.version = 0  # counts the changes of the page tables (and of the host pool)
        dev = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        self.pool = self._stack(read, load, list(device_keys), device_slots + 2 * staging, dev)
        for s, key in enumerate(device_keys):  # a corrupt one is left out: a miss, not zeros
            self._set_slot(s, None if key in self.broken else key)
        self.host: ExpertPool | None = None
        if host_keys is not None:
            pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
            self.host = self._stack(read, load, list(host_keys), host_slots, pinned)
            for s, key in enumerate(host_keys):
                if key not in self.broken:
                    self.host_key[s], self.host_page[key] = key, s
        # the host pool's own buffers as numpy arrays: a disk load is written through them
        self._host_views = (None if self.host is None else
                            {n: host_view(a) for n, a in self.host._asdict().items()
                             if a is not None})
        self._tiers: tuple[int, Tiers] | None = None  # the tables uploaded, at a version

    def _stack(self, read, load, keys: list[Key], slots: int, sharding) -> ExpertPool:
        """`slots` slots of which the first hold `keys` (a corrupt chunk: zeros, recorded). The
        reading threads write each expert into its slot as it arrives, so a pool of many
        gigabytes is never held twice nor copied slot by slot on one thread; a pinned-host
        pool is allocated first and written in place, through its own buffer."""
        def safe(key):
            try:
                return load(key)
            except Exception as err:  # noqa: BLE001  (CheckpointError, or an IO error)
                self.broken[key] = str(err)
                return None

        head = safe(keys[0]) if keys else None
        sample = head or self._sample(load)
        bufs = {n: np.zeros((slots, *a.shape), a.dtype) for n, a in sample.items()}
        pool = None
        if sharding.memory_kind == "pinned_host":
            pool = self._placed(bufs, sharding)
            bufs = {n: host_view(getattr(pool, n)) for n in bufs}

        def fill(job: tuple[int, Key]) -> None:
            slot, key = job
            arrays = head if slot == 0 else safe(key)
            if arrays is not None:
                for n, a in arrays.items():
                    bufs[n][slot] = a

        read(fill, list(enumerate(keys)))
        return self._placed(bufs, sharding) if pool is None else pool

    @staticmethod
    def _placed(bufs: dict[str, np.ndarray], sharding) -> ExpertPool:
        # waited for: a program over pinned host memory may read it before the transfer has
        # landed, and the numpy buffers may be freed once this returns (docs/design.md, "Disk
        # stalls")
        return jax.block_until_ready(
            ExpertPool(**{n: jax.device_put(b, sharding) for n, b in bufs.items()}))

    def _sample(self, load) -> Arrays:
        """Any readable expert's arrays: the shapes of a pool whose own experts all failed."""
        for key in np.ndindex(*self.shape):
            try:
                return load(key)
            except Exception:  # noqa: BLE001, S112
                continue
        raise ValueError(f"no expert of the checkpoint could be read: {self.broken}")

    def release(self) -> None:
        """Free the pool, tier 1 and the uploaded tables now. The host views go first: they
        are raw pointers into tier 1's buffers. Nothing may use the residency afterwards."""
        self._host_views = None
        free(self.pool, self.host, self._tiers)
        self._tiers = None

    # --- page tables ---------------------------------------------------------------------------

    def tiers(self) -> Tiers:
        """The page tables as the step reads them (uploaded again only after a change)."""
        if self._tiers is None or self._tiers[0] != self.version:
            # copies: the CPU backend may alias a numpy argument, and the tables change in
            # place while a dispatched step may still read them
            tiers = jax.device_put(
                Tiers(page=self.page.copy(), host=None, host_page=self.host_page.copy()),
                self.device)
            self._tiers = (self.version, tiers.replace(host=self.host))
        return self._tiers[1]

    def _set_slot(self, slot: int, key: Key | None) -> None:
        old = self.slot_key[slot]
        if old is not None:
            self.page[old] = -1
        self.slot_key[slot] = key
        if key is not None:
            self.page[key] = slot
        self.version += 1

    def slot_of(self, key: Key) -> int | None:
        s = int(self.page[key])
        return None if s < 0 else s

    def on_host(self, key: Key) -> bool:
        return self.host_page[key] >= 0

    @property
    def device_slots(self) -> int:
        return len(self.slot_key)

    # --- moves (between steps) -----------------------------------------------------------------

    def promote(self, key: Key, slot: int) -> None:
        """Copy `key` from the host tier into device slot `slot`, replacing what it held."""
        hs = int(self.host_page[key])
        if hs < 0:
            raise KeyError(f"expert {key} is not in the host tier")
        self.pool = _pull(self.pool, np.int32(slot), self.host, np.int32(hs))
        self._set_slot(slot, key)

    def demote(self, slot: int) -> None:
        """Forget device slot `slot`'s expert (the slot is free)."""
        self._set_slot(slot, None)

    def admit_host(self, key: Key, arrays: Arrays, victim: Key | None) -> None:
        """Write `key` (read from disk) into the host tier: a free host slot, else `victim`'s."""
        free = [s for s, k in enumerate(self.host_key) if k is None]
        if free:
            slot = free[0]
        elif victim is None:
            raise ValueError("the host tier is full and no victim was named")
        else:
            slot = int(self.host_page[victim])
            self.host_page[victim] = -1
        # A memcpy into the pool's buffer (docs/design.md, "Disk stalls"): synchronous, so
        # nothing reads the slot before it has landed, and at the host memory's rate where an
        # update program over pinned memory is far slower. Nothing that reads tier 1 is in
        # flight: a disk load follows a step the host has waited for, and the victim holds no
        # device slot that a pending copy could be filling from.
        for name, view in self._host_views.items():
            np.copyto(view[slot], arrays[name], casting="no")
        self.host_key[slot], self.host_page[key] = key, slot
        self.version += 1


class Residencies:
    """The residency of every device of the expert axis, and the arrays the step reads.

    `parts` are the residencies of this process's devices of the mesh, in mesh order: each
    holds the experts its device owns (`owner` [L, E] == its axis index), in its own slot
    numbers (its tables mark the others -1). On one device the step reads that part's pool
    and tiers as they are; over a mesh (`expert_parallel.programs`), global arrays sharded
    over the axis whose pieces are the parts' own buffers (no copy), the page tables
    [n, L, E], the owner table on every device. Over several processes each gives only its
    own devices' pieces (`jax.make_array_from_single_device_arrays` takes the addressable
    ones), so no process holds another's slots, tier 1 or tables. A pool the step returns
    (donated) goes back to the parts piece by piece."""

    def __init__(self, parts: Sequence[Residency], mesh: Mesh | None = None,
                 owner: np.ndarray | None = None) -> None:
        devices = [p.device for p in parts]
        if (mesh is None) != (owner is None) or (
                len(devices) != 1 if mesh is None else devices != local_devices(mesh)):
            raise ValueError(f"{len(parts)} residencies need one device, or one per device "
                             "of this process on a mesh, in its order, and the owner table")
        self.parts = list(parts)
        self.mesh = mesh
        self._owner = None if mesh is None else place(np.asarray(owner, np.int32),
                                                      NamedSharding(mesh, P()))
        self._tiers: tuple[tuple[int, ...], Tiers] | None = None  # at the parts' versions

    @property
    def pool(self) -> ExpertPool:
        if self.mesh is None:
            return self.parts[0].pool
        return _global([p.pool for p in self.parts], NamedSharding(self.mesh, P(AXIS)))

    @pool.setter
    def pool(self, pool: ExpertPool) -> None:
        if self.mesh is None:
            self.parts[0].pool = pool
            return
        for part, piece in zip(self.parts, _pieces(pool, [p.device for p in self.parts]),
                               strict=True):
            part.pool = piece

    def tiers(self) -> Tiers:
        """The page tables and tier 1 as the step reads them (uploaded after a change)."""
        if self.mesh is None:
            return self.parts[0].tiers()
        versions = tuple(p.version for p in self.parts)
        if self._tiers is None or self._tiers[0] != versions:
            sharded = NamedSharding(self.mesh, P(AXIS))
            page, host_page = (_global_table([(p.device, getattr(p, name)) for p in self.parts],
                                             sharded) for name in ("page", "host_page"))
            host = None
            if self.parts[0].host is not None:
                host = _global([p.host for p in self.parts],
                               NamedSharding(self.mesh, P(AXIS), memory_kind="pinned_host"))
            self._tiers = (versions, Tiers(page=page, host=host, host_page=host_page,
                                           owner=self._owner))
        return self._tiers[1]

    def release(self) -> None:
        """Free every part's buffers and the tables uploaded over the mesh (`Residency.release`)."""
        for part in self.parts:
            part.release()
        free(self._tiers, self._owner)
        self._tiers = None

    @property
    def slot_key(self) -> list[Key | None]:
        """Every device's slots in turn (this process's devices)."""
        return [k for p in self.parts for k in p.slot_key]

    @property
    def host_key(self) -> list[Key | None]:
        """Every device's tier-1 slots in turn (this process's devices)."""
        return [k for p in self.parts for k in p.host_key]


def local_devices(mesh: Mesh) -> list[jax.Device]:
    """The devices of `mesh` that this process drives, in mesh order."""
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def _global(pieces: list[ExpertPool], sharding: NamedSharding) -> ExpertPool:
    """The pool sharded by `sharding` whose pieces are `pieces` (one per device of this
    process, in mesh order; every device's piece has the same slots)."""
    devices = sharding.mesh.devices.size

    def one(*arrays):
        if arrays[0] is None:
            return None
        shape = (devices * arrays[0].shape[0], *arrays[0].shape[1:])
        return jax.make_array_from_single_device_arrays(shape, sharding, list(arrays))

    return ExpertPool(*(one(*arrays) for arrays in zip(*pieces, strict=True)))


def _global_table(tables: list[tuple[jax.Device, np.ndarray]], sharding: NamedSharding
                  ) -> jax.Array:
    """The [n, L, E] table sharded by `sharding` from each local device's own [L, E] (a
    copy: the host tables change in place while a dispatched step may still read them)."""
    pieces = [jax.device_put(t[None].copy(), d) for d, t in tables]
    shape = (sharding.mesh.devices.size, *tables[0][1].shape)
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces)


def _pieces(pool: ExpertPool, devices: list[jax.Device]) -> list[ExpertPool]:
    """`pool`'s piece on each of `devices` (the inverse of `_global`)."""
    def one(a):
        if a is None:
            return [None] * len(devices)
        by_device = {s.device: s.data for s in a.addressable_shards}
        return [by_device[d] for d in devices]

    columns = [one(a) for a in pool]
    return [ExpertPool(*(c[i] for c in columns)) for i in range(len(devices))]


def as_held(arrays: Arrays, tile: tuple[int, int] | None) -> Arrays:
    """An expert's arrays as the pools hold them: packed weights tile-major by `tile`."""
    if tile is None:
        return arrays
    return {n: np.asarray(tile_major(a, *tile)) if n in EXPERT_KINDS else a
            for n, a in arrays.items()}
