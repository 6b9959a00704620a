"""Replay a routing trace through the engine's cache policies, Belady's optimum and a perfect
prefetcher (docs/design.md, "Traces and the simulator").

The access sequence: per step (in order), per layer (in order), the distinct experts the
step's live rows routed to, experts ascending; a key is (layer, expert). Pinned experts are
always hits and never leave. The other hits come from `cache` slots run by the engine's own
admission logic (`cache_policy.admit` over an `ExpertCache`): for each routed key, `touch` if
cached, else (not pinned) `offer` it under the admission rule (`cache_admit`), with the routing
heat of the steps so far, the current one included (`HeatEstimate`, decay 0.9, fed the step's
routing counts as the engine feeds it).

When the cache learns of a step (`admission`):
- "engine": as the engine does: a decode step's record is admitted after the next step was
  dispatched, so step t runs with the admissions of steps <= t - 2 (a one-step lag); a
  prefill step first admits the pending decode record, then its own right away; the last
  step's record is admitted at the end (the engine observes it when its stats are read).
- "demand": the textbook model: a miss is admitted at its access (Belady's model).

Belady (MIN with bypass): offline, the same pinned set and cache slots; on a miss with the
slots full, the key used farthest in the future (the missed one included: bypass) is not
kept. No policy admitting on demand hits more often; one admitting later (the engine) may,
but only by copying experts in again: Belady's misses <= its misses + admissions (`copies`).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import cast

import numpy as np

from strata_jax.formats.config import ModelConfig
from strata_jax.model.misses import MissRates, split
from strata_runtime.engine.trace import RoutingTrace
from strata_runtime.lab.cost_model import HardwareProfile, ModelCost, Prediction, predict
from strata_runtime.residency.cache_policy import (
    POLICIES,
    ExpertCache,
    HeatEstimate,
    admit,
    check_policy,
)
from strata_runtime.residency.heat import ranked

Key = tuple[int, int]
ADMISSIONS = ("engine", "demand")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CacheResult:
    """One replay of a trace: a policy's, or Belady's (`name` "belady")."""

    name: str
    """The policy (static, lru, lfu, lfru) or "belady"."""
    admission: str
    """When the cache learned of a step: "engine" (one-step lag) or "demand"."""
    accesses: int
    """Distinct (layer, expert) routed per step, summed over the steps."""
    hits: int
    """Accesses served by a pinned or a cache slot."""
    pinned_hits: int
    """... of them by a pinned slot."""
    admissions: int
    """Experts put into a cache slot."""
    copies: int
    """Host-to-device expert copies: the misses, plus with "engine" admission the
    admissions (the engine copies an admitted expert into its slot again)."""
    layer_misses: np.ndarray
    """int64 [S, L]: misses per step and layer."""
    hidden: int
    """Misses a perfect prefetcher with `staging` slots would hide (`prefetch_hidden`)."""

    @property
    def misses(self) -> int:
        return self.accesses - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 1.0

    @property
    def prefetch_bound(self) -> float:
        """Share of the misses a perfect prefetcher would hide (1.0 without misses)."""
        return self.hidden / self.misses if self.misses else 1.0


def pinned_by_heat(trace: RoutingTrace, count: int,
                   heat: np.ndarray | None = None) -> list[Key]:
    """The `count` hottest (layer, expert), ranked as `shares.placement` ranks them; `heat`
    [L, E] defaults to the trace's own routing counts (the engine started with `--heat` from a
    recording of the same run)."""
    shape = _Shape(num_layers=trace.num_layers, num_experts=trace.num_experts)
    heat = trace.counts() if heat is None else heat
    return ranked(cast(ModelConfig, shape), heat)[:count]  # ranked reads only the two sizes


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Shape:
    num_layers: int
    num_experts: int


def step_keys(trace: RoutingTrace) -> list[list[Key]]:
    """Per step, the distinct (layer, expert) routed, in the order the engine admits them."""
    e = trace.num_experts
    return [[(k // e, k % e) for k in trace.step_keys(s).tolist()]
            for s in range(trace.num_steps)]


def prefetch_hidden(layer_misses: np.ndarray, staging: int) -> int:
    """Misses hidden by an oracle copying each layer's misses (at most `staging`) while the
    layer before it runs; layer 0 during the previous step's last layer, so only the first
    step's layer 0 cannot be hidden. Copy bandwidth is not modelled: an upper bound."""
    hidden = np.minimum(layer_misses, staging)
    if hidden.size:
        hidden[0, 0] = 0
    return int(hidden.sum())


def simulate(trace: RoutingTrace, policy: str, *, pinned: Sequence[Key], cache: int,
             staging: int, admission: str = "engine", cache_admit: str = "hotter",
             keys: list[list[Key]] | None = None) -> CacheResult:
    """Replay `trace` through `policy` with `pinned` experts and `cache` cache slots, admitting
    by `cache_admit` (`keys`: `step_keys(trace)`, if already computed)."""
    check_policy(policy)
    if admission not in ADMISSIONS:
        raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
    keys = step_keys(trace) if keys is None else keys
    heat = HeatEstimate(trace.num_layers, trace.num_experts)
    replay = _Replay(ExpertCache(policy, cache, cache_admit), set(pinned), heat)
    misses = np.zeros((trace.num_steps, trace.num_layers), np.int64)
    pending: list[Key] = []
    for s, step in enumerate(keys):
        if cache_admit != "always":  # the heat only decides admissions
            heat.end_step()
            picks = trace.step_experts(s)  # [L, n, k]
            for layer in range(trace.num_layers):
                heat.observe(layer, np.bincount(picks[layer].ravel(),
                                                minlength=trace.num_experts))
        if admission == "engine" and trace.prefill[s]:
            replay.admit(pending)
            pending = []
        for key in step:
            if not replay.lookup(key, admit=admission == "demand"):
                misses[s, key[0]] += 1
        if admission == "engine":
            if trace.prefill[s]:
                replay.admit(step)
            else:
                replay.admit(pending)
                pending = step
    if admission == "engine":  # the engine observes its last step when its stats are read
        replay.admit(pending)
    accesses = sum(len(step) for step in keys)
    extra = replay.admissions if admission == "engine" else 0
    return CacheResult(name=policy, admission=admission, accesses=accesses,
                       hits=replay.hits, pinned_hits=replay.pinned_hits,
                       admissions=replay.admissions, copies=int(misses.sum()) + extra,
                       layer_misses=misses, hidden=prefetch_hidden(misses, staging))


class _Replay:
    """The pinned set and an ExpertCache, admitted by `cache_policy.admit` as the engine admits."""

    def __init__(self, cache: ExpertCache, pinned: set[Key], heat: HeatEstimate) -> None:
        self.cache, self.pinned, self.heat = cache, pinned, heat
        self.hits = self.pinned_hits = self.admissions = 0

    def lookup(self, key: Key, admit: bool) -> bool:
        hit = key in self.pinned or key in self.cache
        self.hits += hit
        self.pinned_hits += key in self.pinned
        if admit:
            self.admit([key])
        return hit

    def admit(self, keys: list[Key]) -> None:
        taken = admit(self.cache, keys, self.heat.current(), lambda k: k not in self.pinned)
        self.admissions += len(taken.admitted)


def belady(trace: RoutingTrace, *, pinned: Sequence[Key], cache: int, staging: int,
           keys: list[list[Key]] | None = None) -> CacheResult:
    """Belady's MIN with bypass over the same access sequence: the most hits any cache of
    `cache` slots beside `pinned` can have when experts enter it only as they are routed.
    O(n log n): next uses by one sort, the farthest cached one from a lazy heap."""
    keys = step_keys(trace) if keys is None else keys
    flat = [k for step in keys for k in step]
    where = [(s, k[0]) for s, step in enumerate(keys) for k in step]
    nxt = _next_uses([k[0] * trace.num_experts + k[1] for k in flat])
    pinned_set = set(pinned)
    held: dict[Key, int] = {}  # cached key -> position of its next use
    heap: list[tuple[int, Key]] = []  # (-next use, key); stale entries skipped
    misses = np.zeros((trace.num_steps, trace.num_layers), np.int64)
    hits = pinned_hits = admissions = 0
    for i, key in enumerate(flat):
        if key in pinned_set or key in held:
            hits += 1
            pinned_hits += key in pinned_set
            if key in held:
                held[key] = nxt[i]
                heapq.heappush(heap, (-nxt[i], key))
            continue
        misses[where[i]] += 1
        if cache == 0 or nxt[i] == _NEVER:
            continue
        if len(held) >= cache:
            while held.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if -heap[0][0] < nxt[i]:
                continue  # bypass: every cached key is needed sooner than this one
            del held[heapq.heappop(heap)[1]]
        held[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], key))
        admissions += 1
    return CacheResult(name="belady", admission="demand", accesses=len(flat), hits=hits,
                       pinned_hits=pinned_hits, admissions=admissions,
                       copies=int(misses.sum()), layer_misses=misses,
                       hidden=prefetch_hidden(misses, staging))


_NEVER = 1 << 62


def _next_uses(ids: list[int]) -> list[int]:
    """For each position, the position of the same id's next occurrence (_NEVER: none)."""
    a = np.asarray(ids, np.int64)
    pos = np.arange(len(a))
    order = np.lexsort((pos, a))
    out = np.full(len(a), _NEVER, np.int64)
    same = a[order[1:]] == a[order[:-1]]
    out[order[:-1][same]] = order[1:][same]
    return out.tolist()


def compare(trace: RoutingTrace, policies: Sequence[str] = POLICIES, *,
            pinned: Sequence[Key], cache: int, staging: int,
            admission: str = "engine",
            cache_admit: str = "hotter") -> tuple[list[CacheResult], CacheResult]:
    """Every policy's replay and Belady's, on one access sequence."""
    keys = step_keys(trace)
    results = [simulate(trace, p, pinned=pinned, cache=cache, staging=staging,
                        admission=admission, cache_admit=cache_admit, keys=keys)
               for p in policies]
    return results, belady(trace, pinned=pinned, cache=cache, staging=staging, keys=keys)


def hosted_misses(hw: HardwareProfile, model: ModelCost, layer_misses: np.ndarray,
                  rows: int, miss: str) -> np.ndarray:
    """Of each entry of `layer_misses` (a layer's misses in a step), how many `misses.split`
    puts on the host under `miss` with the profile's rates, every miss of `rows` rows."""
    if miss == "fetch":
        return np.zeros_like(layer_misses)
    rates = MissRates(link_gbps=hw.link_gbps, host_gbps=hw.host_kernel_gbps,
                      row_cost=hw.host_row_cost).array()
    out = np.zeros_like(layer_misses)
    for m in np.unique(layer_misses):
        counts = np.zeros(int(m), np.int32) + rows
        hosted = split(miss, counts, counts > 0, rates, model.bytes_per_expert) if m else 0
        out[layer_misses == m] = int(np.asarray(hosted).sum())
    return out


def predict_replay(hw: HardwareProfile, model: ModelCost, trace: RoutingTrace,
                   result: CacheResult, *, hidden: float = 0.0,
                   batch: float | None = None, miss: str = "fetch") -> Prediction:
    """`cost_model.predict` from a replay's per-decode-step averages (prefill steps left out;
    `batch`: the mean live rows of a decode step unless given); `miss`: the engine's remedy
    for the misses, each layer's split as `misses.split` makes it with the profile's rates
    (`hosted_misses`, every routed expert taking the mean row count)."""
    decode = ~np.asarray(trace.prefill, bool)
    steps = max(int(decode.sum()), 1)
    if batch is None:
        batch = float(trace.live_rows()[decode].mean()) if decode.any() else 1.0
    layer_misses = result.layer_misses[decode]
    routed = sum(len(trace.step_keys(s)) for s in np.flatnonzero(decode)) / steps
    per_layer = max(routed / max(trace.num_layers, 1), 1e-9)
    rows = max(1, int(round(batch * trace.top_k / per_layer)))
    hosted = hosted_misses(hw, model, layer_misses, rows, miss).sum() / steps
    misses = layer_misses.sum() / steps - hosted
    admitted = result.copies - result.misses  # copies beyond the misses themselves
    return predict(hw, model, batch=batch, routed=routed, misses=float(misses),
                   hosted=float(hosted), admissions=admitted / max(trace.num_steps, 1),
                   hidden=hidden)
