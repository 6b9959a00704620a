"""The one place a miss is decided: copied over the link, or computed on the host.

docs/design.md, "Host compute of misses". A miss is an expert a layer routes to that has no
device slot and lies in tier 1. `StepPlan.miss` says what the step does with it: "fetch"
copies every miss into a staging half (bit-identical to resident), "host" computes every miss
on the host cores where its weights lie (`host_experts`), and "auto" splits each layer's
misses so that both finish soonest by a cost model of two rates measured at start-up (or
given): the link's, and the host kernel's with its growth per row. The host's share leaves the
device as the routed rows and comes back as their outputs, while the device copies and
computes the rest; a layer with no host share makes no round trip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from strata_jax.ops import host_experts

MODES = ("fetch", "host", "auto")


@dataclass(frozen=True, kw_only=True)
class MissRates:
    """The rates the "auto" split is decided by (docs/design.md, "Host compute of misses")."""

    link_gbps: float
    """Pinned host -> device copy rate, GB/s."""
    host_gbps: float
    """Expert bytes per second the host kernel reads at one row, GB/s."""
    row_cost: float = 0.0
    """Each further row multiplies the host kernel's one-row time by (1 + row_cost)."""

    def __post_init__(self) -> None:
        for name in ("link_gbps", "host_gbps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"MissRates.{name} must be a positive rate, got {value}")
        if not (math.isfinite(self.row_cost) and self.row_cost >= 0):
            raise ValueError(f"MissRates.row_cost must be >= 0, got {self.row_cost}")

    @classmethod
    def parse(cls, text: str) -> MissRates:
        """'link=48,host=50,row=0.02' (row optional)."""
        names = {"link": "link_gbps", "host": "host_gbps", "row": "row_cost"}
        values: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, raw = item.partition("=")
            if not sep or key not in names:
                raise ValueError(f"miss rates {text!r}: {item!r} is not one of "
                                 "link=GB/s, host=GB/s, row=X")
            try:
                values[names[key]] = float(raw)
            except ValueError:
                raise ValueError(f"miss rates {text!r}: {key} takes a number") from None
        missing = [k for k in ("link", "host") if names[k] not in values]
        if missing:
            raise ValueError(f"miss rates {text!r}: give {' and '.join(missing)}")
        return cls(**values)

    def __str__(self) -> str:
        return f"link={self.link_gbps:.4g},host={self.host_gbps:.4g},row={self.row_cost:.4g}"

    def array(self) -> np.ndarray:
        return np.array([self.link_gbps, self.host_gbps, self.row_cost], np.float32)


@chex.dataclass(frozen=True)
class HostWork:
    """What a step with host compute reads (`step.Tiers.host_work`): `tier` int32 [] the
    registered tier-1 views (`host_experts.register`), `rates` float32 [3] (`MissRates`)."""

    tier: jax.Array
    rates: jax.Array


def split(mode: str, counts: jax.Array, misses: jax.Array, rates: jax.Array | None,
          expert_bytes: int) -> jax.Array:
    """Which of the layer's `misses` [E] bool the host computes ([E] bool). counts [E]: rows
    routed to each expert. "auto": the misses with the fewest rows go to the host, as many as
    make max(host time, link time) least (ties: fewer on the host)."""
    if mode == "fetch":
        return jnp.zeros_like(misses)
    if mode == "host":
        return misses
    e = counts.shape[0]
    order = jnp.argsort(jnp.where(misses, counts, jnp.iinfo(jnp.int32).max), stable=True)
    n = jnp.sum(misses, dtype=jnp.int32)
    link_s, host_s = expert_bytes / (rates[0] * 1e9), expert_bytes / (rates[1] * 1e9)
    rows = counts[order].astype(jnp.float32)
    per_expert = jnp.where(jnp.arange(e) < n, host_s * (1 + rates[2] * (rows - 1)), 0.0)
    hosted = jnp.arange(e + 1)
    host_time = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(per_expert)])
    link_time = jnp.maximum(n - hosted, 0).astype(jnp.float32) * link_s
    cost = jnp.where(hosted <= n, jnp.maximum(host_time, link_time), jnp.inf)
    best = jnp.argmin(cost)
    return jnp.zeros((e,), jnp.bool_).at[order].set(jnp.arange(e) < best) & misses


def host_submit(work: HostWork, hosted, host_row, h, experts, token_live) -> jax.Array:
    """Start the host's share (`hosted` [E]) of a layer: its ticket (int32 []; -1: none)."""
    def go():
        return io_callback(host_experts.submit, jax.ShapeDtypeStruct((), jnp.int32),
                           work.tier, h, experts, token_live, hosted, host_row)

    return jax.lax.cond(jnp.any(hosted), go, lambda: jnp.full((), -1, jnp.int32))


def host_collect(ticket, hosted, experts, picks) -> jax.Array:
    """`picks` [N, k, D] float32 with the host's share filled in, once `picks` (the device's
    share) is done: the device's copies and kernels overlap the host's work."""
    def go():
        out = io_callback(host_experts.collect, jax.ShapeDtypeStruct(picks.shape, jnp.float32),
                          ticket, picks[0, 0, 0])
        return jnp.where(hosted[experts][..., None], out, picks)

    return jax.lax.cond(ticket >= 0, go, lambda: picks)
