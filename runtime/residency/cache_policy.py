"""Which cached expert to evict from the non-pinned HBM slots, and the online heat estimate.

`static`: no cache (misses are staged for one use). `lru`: least recently used. `lfu`: least
frequently used (counts since admission). `lfru`: least frequently used among the older half
by recency, so a burst of new experts cannot flush the frequently used ones.

Admission (`ExpertCache.offer`), when the slots are full: `always` evicts the policy's victim
for every expert copied on demand; `hotter` admits only an expert whose routing heat exceeds
the victim's. Each admission is a second copy over the link (the step used the expert from
staging; `Residency.promote` copies it into the slot), so when a step routes to more experts
than the cache holds, as at large batches, admitting them all copies each twice and evicts
experts the next steps route to again (docs/design.md, "One generation loop").
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

POLICIES = ("static", "lru", "lfu", "lfru")
ADMITS = ("always", "hotter")
Key = tuple[int, int]


def check_policy(kind: str) -> None:
    if kind not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {kind!r}")


def check_admit(kind: str) -> None:
    if kind not in ADMITS:
        raise ValueError(f"cache admission must be one of {ADMITS}, got {kind!r}")


class ExpertCache:
    """Bookkeeping of the cache slots: recency order and use counts of the cached experts."""

    def __init__(self, policy: str, capacity: int, admit: str = "always") -> None:
        check_policy(policy)
        check_admit(admit)
        self.policy, self.admit = policy, admit
        self.capacity = capacity if policy != "static" else 0
        self._order: OrderedDict[Key, None] = OrderedDict()
        self._uses: dict[Key, int] = {}

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, key: Key) -> None:
        self._order.move_to_end(key)
        self._uses[key] += 1

    def add(self, key: Key) -> None:
        self._order[key] = None
        self._uses[key] = 1

    def remove(self, key: Key) -> None:
        del self._order[key]
        del self._uses[key]

    def offer(self, key: Key, heat: np.ndarray) -> tuple[bool, Key | None]:
        """Admit `key` (routed, not cached) by the admission rule, `heat` [L, E] the routing
        heat: (admitted, the expert it evicted or None)."""
        if len(self) < self.capacity:
            self.add(key)
            return True, None
        victim = self.victim()
        if self.admit == "hotter" and heat[key] <= heat[victim]:
            return False, None
        self.remove(victim)
        self.add(key)
        return True, victim

    def victim(self) -> Key:
        # min() keeps the first of equal keys, so ties go to the least recent: O(capacity)
        if self.policy == "lru":
            return next(iter(self._order))  # least recent first
        if self.policy == "lfu":
            return min(self._order, key=self._uses.__getitem__)
        older = itertools.islice(self._order, max(1, len(self._order) // 2))
        return min(older, key=self._uses.__getitem__)


@dataclass(frozen=True)
class Admissions:
    """One step's cache decisions (`admit`): what the engine applies to its slots and the
    simulator counts."""

    touched: tuple[Key, ...]
    """Cached experts routed again (their recency and use count refreshed)."""
    admitted: tuple[tuple[Key, Key | None], ...]
    """Experts taken into a cache slot, each with the cached one it replaces (None: a free
    slot)."""


def admit(cache: ExpertCache, routed: Iterable[Key], heat: np.ndarray,
          eligible: Callable[[Key], bool]) -> Admissions:
    """The cache policy over one step's routed experts, in order: a cached one is touched,
    an `eligible` other one (copied on demand: no device slot of its own; or evicted earlier
    in the same step, its slot going to the expert that evicted it) is offered under the
    admission rule with the routing `heat` [L, E]. The cache's bookkeeping advances; the
    returned value is the step's decisions: the one admission logic of the engine and of the
    simulator's replay (docs/design.md, "One generation loop")."""
    if cache.capacity == 0:
        return Admissions(touched=(), admitted=())
    touched, admitted, evicted = [], [], set()
    for key in routed:
        if key in cache:
            cache.touch(key)
            touched.append(key)
        elif key in evicted or eligible(key):  # evicted by this step: its slot is taken
            taken, victim = cache.offer(key, heat)
            if taken:
                admitted.append((key, victim))
                evicted.add(victim)
    return Admissions(touched=tuple(touched), admitted=tuple(admitted))


class HeatEstimate:
    """EMA of per-(layer, expert) routing counts, updated once per step."""

    def __init__(self, num_layers: int, num_experts: int, decay: float = 0.9) -> None:
        self.decay = decay
        self.heat = np.zeros((num_layers, num_experts), np.float64)
        self._step = np.zeros_like(self.heat)
        self.counts = np.zeros_like(self.heat)  # every routing assignment seen

    def observe(self, layer: int, counts: np.ndarray) -> None:
        """Add one step's routing counts [experts] of `layer` (tokens routed to each)."""
        self._step[layer] += counts
        self.counts[layer] += counts

    def observe_all(self, counts: np.ndarray) -> None:
        """Add one step's routing counts [layers, experts] of every layer."""
        self._step += counts
        self.counts += counts

    def end_step(self) -> None:
        self.heat = self.current()
        self._step[:] = 0

    def current(self) -> np.ndarray:
        """The heat with the step observed so far folded in (what `end_step` will make it)."""
        return self.decay * self.heat + (1 - self.decay) * self._step


def rebalance(heat: np.ndarray, pinned: set[Key], hysteresis: float) -> list[tuple[Key, Key]]:
    """(out, in) swaps that move the hottest experts into the pinned set.

    An outside expert replaces the coldest pinned one only if it is hotter by a factor
    (1 + hysteresis), so experts of similar heat do not ping-pong between tiers.
    """
    swaps: list[tuple[Key, Key]] = []
    pinned = set(pinned)
    flat = np.argsort(-heat, axis=None)
    outside = [tuple(map(int, np.unravel_index(i, heat.shape))) for i in flat]
    for cand in outside:
        if cand in pinned or not pinned:
            continue
        coldest = min(pinned, key=lambda k: heat[k])
        if heat[cand] <= (1 + hysteresis) * heat[coldest]:
            break
        pinned.remove(coldest)
        pinned.add(cand)
        swaps.append((coldest, cand))
    return swaps
