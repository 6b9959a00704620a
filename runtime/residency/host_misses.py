"""The engine's side of host compute: the tier-1 views the step's host kernel reads, and the
rates the "auto" split decides by (docs/design.md, "Host compute of misses").

The tier-1 pool is replaced (donated in place) when the disk tier admits an expert; each
version gets views of its own under a new id, and the step carries the id of the version it
was dispatched with. The last few versions stay registered, since a dispatched step may still
read the one before.
"""

from __future__ import annotations

from collections import deque

import jax
import numpy as np

from strata_jax.formats.config import ModelConfig
from strata_jax.model.misses import HostWork, MissRates, split
from strata_jax.ops import host_experts
from strata_jax.ops.pool import ExpertPool
from strata_runtime.residency.timeline import Timeline

KEEP = 3  # tier-1 versions kept registered: the current one and those a step may still read


class HostMisses:
    """Registered views of the tier-1 pool, the rates, and what the host computed."""

    def __init__(self, device: jax.Device, host: ExpertPool, rates: MissRates | None,
                 threads: int | None) -> None:
        """`rates` None: the host kernel on `host` and the link to `device` are timed now, at
        work at once (`host_experts.measure_with_copies`); fixed rates make "auto"
        reproducible."""
        host_experts.check_pool(host)
        self.device = device
        self.threads = host_experts.set_threads(threads)
        self._versions: deque[tuple[ExpertPool, int]] = deque()
        self._done = dict.fromkeys(host_experts.TOTALS, 0.0)  # of released versions
        self._tracing = False
        tier_id = self._register(host)
        if rates is None:
            link_gbps, host_gbps, row_cost = host_experts.measure_with_copies(tier_id, device)
            rates = MissRates(link_gbps=link_gbps, host_gbps=host_gbps, row_cost=row_cost)
        self.rates = rates
        self._work = self._device_work(tier_id)
        self.reset()

    def _register(self, host: ExpertPool) -> int:
        tier_id = host_experts.register(host)
        self._versions.append((host, tier_id))
        while len(self._versions) > KEEP:
            _, old = self._versions.popleft()
            t = host_experts.tier(old)
            for name in host_experts.TOTALS:
                self._done[name] += getattr(t, name)
            host_experts.release(old)
        return tier_id

    def _device_work(self, tier_id: int) -> HostWork:
        return jax.device_put(HostWork(tier=np.int32(tier_id), rates=self.rates.array()),
                              self.device)

    def work(self, host: ExpertPool) -> HostWork:
        """What a step reading tier-1 pool `host` passes to its host kernel."""
        if self._versions[-1][0] is not host:
            self._work = self._device_work(self._register(host))
        return self._work

    def _totals(self) -> dict[str, float]:
        tiers = [host_experts.tier(i) for _, i in self._versions]
        return {name: self._done[name] + sum(getattr(t, name) for t in tiers)
                for name in host_experts.TOTALS}

    def reset(self) -> None:
        """Count from now on (`summary`)."""
        self._base = self._totals()
        host_experts.recent_round_trips()

    def summary(self, bytes_per_expert: int) -> dict[str, object]:
        """What the host computed since `reset`, and where its layers' round trips went: per
        round trip, the worker's start after `submit` (queue), the kernel, the device's wait
        in `collect` and the host's outputs' wait for the device (docs/design.md, "Stats")."""
        now = self._totals()
        d = {name: now[name] - self._base[name] for name in now}
        busy, trips = d["busy_s"], d["trips"]

        def per_trip(seconds: float) -> float | None:
            return 1e3 * seconds / trips if trips else None

        return {"host_compute_s": busy,
                "host_gbps": d["experts"] * bytes_per_expert / busy / 1e9 if busy else None,
                "host_round_trips": int(trips), "host_queue_ms": per_trip(d["queue_s"]),
                "host_kernel_ms": per_trip(busy), "host_wait_ms": per_trip(d["wait_s"]),
                "host_early_ms": per_trip(d["early_s"]),
                "host_threads": self.threads, "miss_rates": str(self.rates)}

    def trace_round_trips(self) -> None:
        """Keep each layer's round trip for `add_spans` (the engine's timeline is on)."""
        host_experts.record_round_trips(True)
        self._tracing = True

    def add_spans(self, timeline: Timeline) -> None:
        """The round trips kept since the last call as spans: the kernel on the host, the
        device waiting in `collect`, and the whole share from `submit` to its outputs."""
        for trip in host_experts.recent_round_trips():
            args = {"experts": trip.experts, "rows": trip.rows}
            timeline.add("host experts", "host", trip.started, trip.ended,
                         lane="host kernel", **args)
            timeline.add("layer's host share", "host", trip.submitted, trip.returned,
                         lane="host round trips", **args)
            timeline.add("device waits for the host", "stall", trip.collected, trip.returned,
                         lane="device waits for the host")

    def close(self) -> None:
        if self._tracing:
            host_experts.record_round_trips(False)
        while self._versions:
            host_experts.release(self._versions.popleft()[1])


def predicted_split(cfg: ModelConfig, *, mode: str, rates: MissRates, tier0: int, batch: int,
                    bytes_per_expert: int) -> dict[str, float]:
    """What `misses.split` does with a decode step's misses of one layer under uniform
    routing (`strata plan`): B rows pick ~E (1 - (1 - k/E)^B) distinct experts, of which the
    share tier0 / (L E) has a device slot; every routed expert gets the mean row count."""
    e, k = cfg.num_experts, cfg.top_k
    distinct = e * (1 - (1 - k / e) ** batch)
    misses = int(round(distinct * (1 - tier0 / (cfg.num_layers * e))))
    rows = max(1, int(round(batch * k / max(distinct, 1e-9))))
    counts = np.zeros(e, np.int32)
    counts[:misses] = rows
    hosted = int(np.asarray(split(mode, counts, counts > 0, rates.array(),
                                  bytes_per_expert)).sum())
    link_s = bytes_per_expert / (rates.link_gbps * 1e9)
    host_s = bytes_per_expert / (rates.host_gbps * 1e9) * (1 + rates.row_cost * (rows - 1))
    return {"distinct": distinct, "misses": misses, "rows": rows, "hosted": hosted,
            "layer_ms": 1e3 * max(hosted * host_s, (misses - hosted) * link_s),
            "link_only_ms": 1e3 * misses * link_s}
