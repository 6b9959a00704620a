"""Reading experts from disk: one expert as the pools hold it (`ExpertLoader`), the start-up
pools' reads (`start_reads`); and a step stalled on disk: which experts its layer loads into
tier 1 and over which victims (`plan_loads`), which rows an unreadable expert fails
(`rows_routed`), and the failures every process agrees on (`agreed_errors`). docs/design.md,
"Disk stalls"."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from strata_jax import api
from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.formats.quant import dequantize_int4_jnp
from strata_jax.step import expert_parallel
from strata_runtime.engine.processes import process_sum
from strata_runtime.engine.shares import Share
from strata_runtime.residency.numa import NumaPlan, bind_current_thread
from strata_runtime.residency.tiers import Key, Residency, as_held


def plan_loads(shares: Sequence[Share], share_of: Callable[[Key], Share | None],
               keys: list[Key], ahead: Sequence[Key], counts: np.ndarray, heat: np.ndarray
               ) -> tuple[list[Key], list[Key], dict[Key, Key | None]]:
    """(the stalled layer's `keys` this process loads, the later layers' disk experts `ahead`
    it loads too, each load's victim in its owner's tier 1 (None: a free slot)). The coldest
    host experts outside the layer's routed ones (`counts` [L, E], the step's) make room for
    `keys`; the experts `ahead` (routed on an input that lacked the stalled layer's experts,
    so most are the re-run's too) take the room left outside the step's routed experts, so a
    step stalls once where it would stall at layer after layer."""
    layer = keys[0][0]
    routed = {(layer, int(e)) for e in np.nonzero(counts[layer] > 0)[0]}
    step_routed = {(int(lr), int(e)) for lr, e in np.argwhere(counts > 0)}
    mine = [k for k in keys if share_of(k) is not None]
    victims: dict[Key, Key | None] = {}
    extra: list[Key] = []
    for share in shares:
        need = [k for k in mine if share_of(k) is share]
        want = [k for k in dict.fromkeys(ahead) if share_of(k) is share]
        residency = share.residency
        free = sum(k is None for k in residency.host_key)
        spare = host_victims(residency, heat, len(need), routed)
        rest = [v for v in host_victims(residency, heat, len(residency.host_key) + free,
                                        step_routed) if v not in spare]
        room = iter([None] * free + spare + rest)
        victims.update((k, next(room)) for k in need)
        for key in want[: max(0, free - len(need)) + len(rest)]:
            victims[key] = next(room)
            extra.append(key)
    return mine, extra, victims


def host_victims(residency: Residency, heat: np.ndarray, count: int, keep: set[Key]
                 ) -> list[Key]:
    """Experts of `residency`'s tier 1 to overwrite for `count` loads beyond its free slots,
    coldest by `heat` first, none in `keep` or with a device slot."""
    held = [k for k in residency.host_key if k is not None]
    free = sum(k is None for k in residency.host_key)
    candidates = [k for k in held if k not in keep and residency.slot_of(k) is None]
    candidates.sort(key=lambda k: heat[k])
    return candidates[: max(0, count - free)]


def rows_routed(record, key: Key, args: tuple, capacity: int, live: Sequence[bool]
                ) -> list[int]:
    """Live rows whose tokens routed to `key` in the step of `record` (`args`: a prefill
    program's arguments, whose token i is row args[0][i // T]'s, real below its count, then
    one token per rider; empty: a decode step)."""
    layer, expert = key
    picked = (np.asarray(record.experts[layer]) == expert).any(axis=-1)
    if args:
        rows, tokens, _, counts, _, riders = args[:6]
        real = np.arange(tokens.shape[1])[None] < counts[:, None]
        main = picked[: tokens.size].reshape(tokens.shape)
        hit = (main & real).any(axis=1) & (rows < capacity)
        return [int(r) for r in rows[hit]] + [
            int(r) for r in np.nonzero(picked[tokens.size:] & riders)[0]]
    return [int(r) for r in np.nonzero(picked & np.array(live))[0]]


def agreed_errors(keys: list[Key], errors: dict[Key, str], processes: int) -> dict[Key, str]:
    """The experts of `keys` that could not be read on any process (each reads only its own:
    the others learn of a failure by an all-gather, so all fail the same rows)."""
    if processes == 1:
        return errors
    bad = process_sum(np.array([k in errors for k in keys], np.int32), processes)
    return {k: errors.get(k, f"expert {k[1]} of layer {k[0]}: its owner's process could "
                             "not read it")
            for k, b in zip(keys, bad, strict=True) if b}


@dataclass(frozen=True)
class ExpertLoader:
    """Reads one expert from the checkpoint, verified, as the pools hold it (`dequantize`:
    int4 experts as bfloat16, on the host's CPU device; `tile`: tile-major int4 slots)."""

    reader: CheckpointReader
    dequantize: bool
    tile: tuple[int, int] | None

    def __call__(self, key: Key) -> dict[str, np.ndarray]:
        arrays = {n: self.reader.read_expert(*key, n) for n in self.reader.expert_specs}
        if self.dequantize:  # the weights dequantized; biases (never quantized) as stored
            arrays = {n: (np.asarray(_dequantize_on_cpu(a, arrays[f"{n}_scale"]))
                          if f"{n}_scale" in arrays else a)
                      for n, a in arrays.items() if not n.endswith("_scale")}
        return as_held(arrays, self.tile)

    def attempt(self, key: Key) -> dict[str, np.ndarray] | str:
        """The expert's arrays, or why it could not be read."""
        try:
            return self(key)
        except Exception as err:  # noqa: BLE001  (CheckpointError, IO errors)
            return f"expert {key[1]} of layer {key[0]}: {err}"


def start_reads(numa: NumaPlan, fetch_threads: int) -> Callable:
    """`read(fn, keys)` for the start-up pools. Each chunk's sha256 binds a core (a core
    hashes at about a third of the rate it reads from the page cache), so they take the NUMA
    node's cores (up to 16), not the `fetch_threads` that serve stalls between steps."""

    def read(fn: Callable, keys: list[Key]) -> list:
        cores = len(numa.cpus) if numa.binds else os.cpu_count() or 1
        with ThreadPoolExecutor(max(fetch_threads, min(16, cores)),
                                thread_name_prefix="strata-start",
                                initializer=bind_current_thread, initargs=(numa,)) as pool:
            return list(pool.map(fn, keys))

    return read


@functools.cache
def host_device() -> jax.Device:
    """This process's host device (looked up on first use: importing the engine must not
    start the backend before `jax.distributed.initialize`)."""
    return jax.local_devices(backend="cpu")[0]


def _dequantize_on_cpu(packed: np.ndarray, scales: np.ndarray) -> jax.Array:
    with jax.default_device(host_device()):
        return _dequant_jit(packed, scales)


_dequant_jit = jax.jit(lambda p, s: dequantize_int4_jnp(p, s, jnp.bfloat16))


def read_dense(reader: CheckpointReader, everyone: NamedSharding | None) -> dict:
    """The checkpoint's dense params on the default device, or (`everyone`: a replicated
    sharding over a mesh) read on the host and placed on every device, so that the first
    device receives no second copy."""
    if everyone is None:
        return api.read_dense_params(reader)
    with jax.default_device(host_device()):
        return expert_parallel.place(api.read_dense_params(reader), everyone)
