"""The experts each device of an engine starts with (`start_shares`): its pinned set, its
cache slots and its share of tier 1, placed by heat, sized by the ledger (or the overrides),
and its read-ahead from disk."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from strata_jax.formats.checkpoint import CheckpointError, CheckpointReader
from strata_jax.formats.config import ModelConfig
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.plan import slot_bytes, tier1_floor
from strata_runtime.residency.cache_policy import ExpertCache, admit, rebalance
from strata_runtime.residency.heat import ranked
from strata_runtime.residency.ledger import Ledger, default_staging_slots, even_share
from strata_runtime.residency.numa import NumaPlan, bind_current_thread
from strata_runtime.residency.read_ahead import ReadAhead
from strata_runtime.residency.tiers import Key, Residency

log = logging.getLogger("strata.engine")


@dataclass
class Share:
    """What one device of the expert axis holds and decides for the experts it owns: its
    residency (its slots, staging and share of tier 1, in its own slot numbers), its pinned
    set and its cache slots' policy."""

    device: int
    """Its index on the expert axis (`ExpertLayout.owner`'s value for its experts)."""
    residency: Residency
    pinned: set[Key]
    cache: ExpertCache
    ahead: ReadAhead
    """Its disk experts read ahead into its tier 1."""

    def admit(self, routed: list[Key], heat: np.ndarray) -> int:
        """Its cache policy over a step's `routed` experts of its own (`cache_policy.admit`,
        the simulator's logic too), applied to its slots: how many it admitted."""
        residency = self.residency
        decided = admit(self.cache, routed, heat,
                        lambda k: residency.slot_of(k) is None and residency.on_host(k))
        for key, victim in decided.admitted:
            # no victim: the cache is not full, a device slot holds nothing (slots = pinned
            # + cache capacity; a pinned expert whose chunk is broken leaves one free)
            slot = residency.slot_key.index(None) if victim is None else \
                residency.slot_of(victim)
            residency.promote(key, slot)
        return len(decided.admitted)

    def rebalance(self, heat: np.ndarray, hysteresis: float) -> int:
        """Swap experts hotter by `heat` (its own experts'; -inf elsewhere) into its pinned
        slots (`cache_policy.rebalance`): how many it swapped."""
        residency, cache, swaps = self.residency, self.cache, 0
        for out, new in rebalance(heat, self.pinned, hysteresis):
            if not residency.on_host(new):
                continue  # only on disk: it comes up through the host tier first
            slot = residency.slot_of(out)
            if new in cache:
                cache.remove(new)
                residency.demote(residency.slot_of(new))
            residency.promote(new, slot)
            self.pinned.discard(out)
            self.pinned.add(new)
            swaps += 1
        return swaps


@dataclass(frozen=True, kw_only=True)
class ExpertLayout:
    """Where an engine's experts are, fixed at start-up (`Engine.layout`)."""

    devices: list[jax.Device]
    """The expert axis: the first `EngineConfig.expert_devices` devices."""
    owner: np.ndarray
    """int32 [L, E]: the device (index on the axis) that owns each expert."""
    ledger: Ledger | None
    """The HBM budget's split (`plan_for`); None without a budget (every expert a slot)."""
    resident: bool
    """Every expert has a device slot."""
    staging: int
    """Experts per staging half (0: resident)."""


@dataclass(frozen=True, kw_only=True)
class Start:
    """What `start_shares` gives an engine."""

    shares: list[Share]
    """This process's devices' shares."""
    layout: ExpertLayout
    """Where the experts are (the engine's `layout`)."""
    disk_possible: bool
    """Some experts lie only on disk: a step may stall there."""


def placement(cfg: ModelConfig, pinned: int, host: int, heat: np.ndarray | None = None,
              mine: np.ndarray | None = None) -> tuple[list[Key], list[Key]]:
    """The `pinned` hottest experts, and the `host` experts of tier 1 (the others first, then
    the pinned ones, which rebalancing may demote); of those `mine` (bool [L, E]) marks, if
    given."""
    order = [k for k in ranked(cfg, heat) if mine is None or mine[k]]
    return order[:pinned], (order[pinned:] + order[:pinned])[:host]


def start_shares(*, cfg: ModelConfig, config: EngineConfig, reader: CheckpointReader,
                 ledger: Ledger | None, owner: np.ndarray, devices: list[jax.Device],
                 local: list[int], heat: np.ndarray | None, load: Callable, try_load: Callable,
                 read: Callable, numa: NumaPlan, rows: int) -> Start:
    """Each device's residency, pinned set and cache: its hottest experts (by `heat`, else
    spread over the layers) pinned, the next in its cache slots as they are routed, the rest
    in its share of tier 1 as far as it goes; only the `local` devices' (every process plans
    them all alike, so the global pools' shapes agree). `load` / `try_load` read one expert
    (the latter returning why it failed), `read` maps a read over the start-up's keys, `rows`
    the most tokens a program routes."""
    mine = [owner == d for d in range(len(devices))]
    owned = [int(m.sum()) for m in mine]
    slots, host, staging = _tier_sizes(cfg, config, reader, ledger, owner, len(devices),
                                       max(owned))
    resident = all(slots >= n for n in owned)
    cache = 0 if resident or config.policy == "static" else int(config.cache_fraction * slots)
    placed = [placement(cfg, slots - cache, host, heat, m) for m in mine]
    staging = 0 if resident else staging
    disk_possible = not resident and any(host < n for n in owned)
    host_slots = max(_host_slots(cfg, config, rows, len(pinned), cache, host, m)
                     for (pinned, _), m in zip(placed, mine, strict=True))
    shares = []
    for d in local:
        pinned, host_keys = placed[d]
        residency = Residency(cfg.num_layers, cfg.num_experts, devices[d], load, pinned, slots,
                              staging, None if resident else host_keys, host_slots, read=read)
        _refuse_broken(reader, residency.broken, staging)
        ahead = ReadAhead(config.read_ahead if disk_possible else 0, config.hysteresis,
                          try_load, functools.partial(bind_current_thread, numa))
        shares.append(Share(d, residency, set(pinned) - residency.broken.keys(),
                            ExpertCache(config.policy, cache, config.cache_admit), ahead))
    layout = ExpertLayout(devices=devices, owner=owner, ledger=ledger, resident=resident,
                          staging=staging)
    return Start(shares=shares, layout=layout,
                 disk_possible=disk_possible)

def _refuse_broken(reader: CheckpointReader, broken: dict[Key, str], staging: int) -> None:
    """A resident engine has no miss path to fail the requests that route to an expert whose
    chunk could not be read (an offloaded one treats it as a miss on disk, which fails those
    requests alone): it refuses to start, naming the experts."""
    if broken and staging == 0:
        (layer, expert), error = next(iter(broken.items()))
        raise CheckpointError(
            f"{reader.path}: {len(broken)} expert(s) could not be read, e.g. expert "
            f"{expert} of layer {layer}: {error}. Every expert has a device slot in this "
            "engine, so their requests cannot fail alone: repair the checkpoint, or give "
            "a budget (hbm_budget, resident_experts) that leaves experts on the host tiers")

def _tier_sizes(cfg: ModelConfig, config: EngineConfig, reader: CheckpointReader,
                ledger: Ledger | None, owner: np.ndarray, n: int, most: int
                ) -> tuple[int, int, int]:
    """Each of `n` devices' (tier-0 slots, tier-1 experts, staging) when a device owns at most
    `most` experts: from the ledger, unless overridden."""
    slots, host = most, most
    staging = config.staging_slots or default_staging_slots(
        slot_bytes(reader, config), config.batch_capacity, n)
    if ledger is not None:
        slots, staging = ledger.pool_slots, ledger.staging_slots or staging
        host = ledger.host_share  # tier 1 holds experts as the slots do
    if config.resident_experts is not None:
        slots = config.resident_experts
    if config.host_experts is not None:
        host = even_share(config.host_experts, cfg.num_layers * cfg.num_experts, n, most)
    per_layer = int(max((owner == d).sum(axis=1).max() for d in range(n)))
    return min(slots, most), min(host, most), min(staging, per_layer)

def _host_slots(cfg: ModelConfig, config: EngineConfig, rows: int, pinned: int, cache: int,
                host: int, mine: np.ndarray) -> int:
    """A device's tier-1 slots: `host`, but at least `tier1_floor` (the extra slots start
    empty); warns when that is more than the budget gave."""
    floor = tier1_floor(cfg.top_k, owned=int(mine.sum()),
                        owned_per_layer=int(mine.sum(axis=1).max()), pinned=pinned,
                        cache=cache, rows=rows, rebalance=bool(config.rebalance_every))
    if floor > host:
        log.warning("tier 1 holds %d experts where the host budget gives %d: a step that "
                    "stalls on disk resumes at a layer once its experts are all in tier 1 "
                    "(`strata plan` names the knobs)", floor, host)
    return max(host, floor)
