"""What a timed run did, from the engine's counters, and the bytes and FLOPs that makes
(docs/design.md, "Benchmarks and sweeps"); `strata_runtime.lab.bench` module docstring says what
each byte count holds. The bound and the prediction made of these live in
`strata_runtime.lab.cost_model`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from strata_jax.formats.config import ModelConfig
from strata_runtime.engine.stats import DeviceCounts, EngineStats, PhaseCounts


@dataclasses.dataclass(kw_only=True)
class Counts:
    """What one timed run did, from the engine's counters (additive over repeats): the
    decode steps' and the prefill chunks' work apart (`decode`, `prefill`; `total` both)."""

    wall_s: float = 0.0
    new_tokens: int = 0
    decode_steps: int = 0
    """Timed decode steps (`decode.calls` also counts the compiling one)."""
    decode_tokens: int = 0
    decode_s: float = 0.0
    host_s: float = 0.0
    """The engine's own host work in its decode steps (`EngineStats.host_s`)."""
    dispatch_s: float = 0.0
    """... its calls of the decode program (`EngineStats.dispatch_s`)."""
    launch_s: float = 0.0
    """... of which the calls that return before their program ends (`EngineStats.launch_s`)."""
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    swaps: int = 0
    read_ahead: int = 0
    decode: PhaseCounts = dataclasses.field(default_factory=PhaseCounts)
    """The decode steps' counters, which the cost model's prediction reads."""
    prefill: PhaseCounts = dataclasses.field(default_factory=PhaseCounts)
    devices: tuple[DeviceCounts, ...] = ()
    """Each device's share (`EngineStats.devices`)."""

    @classmethod
    def of(cls, counters: EngineStats, wall_s: float, new_tokens: int) -> Counts:
        """A copy of the engine's counters of a run of `wall_s` seconds that generated
        `new_tokens` tokens."""
        c = counters
        return cls(wall_s=wall_s, new_tokens=new_tokens, decode_steps=c.decode_steps,
                   decode_tokens=c.decode_tokens, decode_s=c.decode_s, host_s=c.host_s,
                   dispatch_s=c.dispatch_s, launch_s=c.launch_s,
                   prefill_tokens=c.prefill_tokens, prefill_s=c.prefill_s, swaps=c.swaps,
                   read_ahead=c.read_ahead,
                   decode=dataclasses.replace(c.decode), prefill=dataclasses.replace(c.prefill),
                   devices=tuple(dataclasses.replace(d) for d in c.devices))

    def __add__(self, other: Counts) -> Counts:
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name)
                  for f in dataclasses.fields(self) if f.name != "devices"}
        devices = (tuple(a + b for a, b in zip(self.devices, other.devices, strict=True))
                   if self.devices and other.devices else self.devices or other.devices)
        return Counts(**summed, devices=devices)

    @property
    def total(self) -> PhaseCounts:
        """Both phases' counters summed."""
        return self.decode + self.prefill

    @property
    def prefill_chunks(self) -> int:
        return self.prefill.calls

    @property
    def steps(self) -> int:
        """Program calls: decode steps and prefill chunks."""
        return self.decode_steps + self.prefill_chunks

    def doc(self) -> dict[str, Any]:
        """The JSON form: the fields, and both phases' totals at the top level."""
        totals = {k: v for k, v in dataclasses.asdict(self.total).items() if k != "calls"}
        return {**dataclasses.asdict(self), **totals, "prefill_chunks": self.prefill_chunks}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    """Bytes and FLOPs of the engine's model, as its slots and state hold them."""

    bytes_per_expert: int
    dense_bytes: int
    """Read per program call: dense params but the embedding table (unless tied)."""
    kv_bytes: int
    """The whole KV cache (a decode step reads it all; a prefill chunk its row's share)."""
    rows: int
    flops_per_token: float

    def hbm_bytes(self, c: Counts) -> float:
        return (c.steps * self.dense_bytes + c.decode_steps * self.kv_bytes
                + c.prefill_chunks * self.kv_bytes / self.rows
                + c.total.routed * self.bytes_per_expert)

    def h2d_bytes(self, c: PhaseCounts) -> int:
        return (c.fetched + c.issued + c.admissions) * self.bytes_per_expert

    def busiest_link_bytes(self, c: Counts) -> int:
        """Host -> device bytes of the busiest device's link (all of them on one device)."""
        return max((d.h2d_bytes(self.bytes_per_expert) for d in c.devices),
                   default=self.h2d_bytes(c.total))

    def disk_bytes(self, c: PhaseCounts) -> int:
        return c.disk_loads * self.bytes_per_expert

    def hosted_bytes(self, c: PhaseCounts) -> int:
        """Expert bytes the host kernel read (misses computed on the host)."""
        return c.hosted * self.bytes_per_expert

    def flops(self, c: Counts) -> float:
        return self.flops_per_token * (c.decode_tokens + c.prefill_tokens)


def dense_bytes(cfg: ModelConfig, params: dict[str, Any]) -> int:
    """Bytes a decode step reads of the dense params: all of them but the embedding table (a
    step reads a row of it), which it reads whole as the lm head where the two are tied."""
    embed = params["params"]["embed"]
    return (sum(a.nbytes for a in jax.tree.leaves(params))
            - (0 if cfg.tie_word_embeddings else embed.nbytes))


def routed_gbps(c: Counts, sizes: Sizes) -> float | None:
    """The decode steps' effective routed-expert bandwidth: the bytes of every distinct expert
    a step routed to (as the slots hold them), wherever it was served from, over the decode
    seconds: what the write-up's peers report against the link and host DRAM rates."""
    if c.decode_s <= 0:
        return None
    return c.decode.routed * sizes.bytes_per_expert / c.decode_s / 1e9


def device_figures(c: Counts, sizes: Sizes) -> list[dict[str, Any]]:
    """Each device's link bytes (demand copies, prefetches, admissions to its own slots), its
    rate over the engine's time (decode steps and prefill chunks) and the share of its
    measured link that is."""
    engine_s = c.decode_s + c.prefill_s
    out = []
    for d in c.devices:
        h2d = d.h2d_bytes(sizes.bytes_per_expert)
        gbps = h2d / engine_s / 1e9 if engine_s > 0 else None
        out.append({"device": d.device, "h2d_bytes": h2d, "h2d_GB_per_step":
                    h2d / max(c.steps, 1) / 1e9, "h2d_gbps": gbps, "link_gbps": d.link_gbps,
                    "link_busy": gbps / d.link_gbps if gbps is not None and d.link_gbps
                    else None, "fetched": d.fetched, "issued": d.issued,
                    "admissions": d.admissions, "disk_loads": d.disk_loads})
    return out


def _per_step(c: Counts, sizes: Sizes) -> dict[str, float]:
    """Bytes and milliseconds per program call, and the decode steps' disk figures."""
    per = max(c.steps, 1)
    decode = max(c.decode.calls, 1)
    t = c.total
    return {"hbm_GB": sizes.hbm_bytes(c) / per / 1e9,
            "h2d_GB": sizes.h2d_bytes(t) / per / 1e9,
            "disk_GB": sizes.disk_bytes(t) / per / 1e9,
            "ms_engine": 1e3 * (c.decode_s + c.prefill_s) / per,
            "ms_disk_stall": 1e3 * t.disk_stall_s / per,
            "decode_disk_GB": sizes.disk_bytes(c.decode) / decode / 1e9,
            "decode_ms_disk_stall": 1e3 * c.decode.disk_stall_s / decode}


def figures(c: Counts, sizes: Sizes, steps_s: list[float]) -> dict[str, Any]:
    """The per-run figures a row reports (step percentiles over `steps_s`)."""
    times = np.asarray(steps_s) if steps_s else None
    t = c.total
    return {
        "tok_s": c.new_tokens / c.wall_s if c.wall_s > 0 else None,
        "decode_tok_s": c.decode_tokens / c.decode_s if c.decode_s > 0 else None,
        "prefill_tok_s": c.prefill_tokens / c.prefill_s if c.prefill_s > 0 else None,
        "prefill_h2d_MB_per_token": (sizes.h2d_bytes(c.prefill) / c.prefill_tokens / 1e6
                                     if c.prefill_tokens else None),
        "step_ms_p50": float(np.percentile(times, 50) * 1e3) if times is not None else None,
        "step_ms_p99": float(np.percentile(times, 99) * 1e3) if times is not None else None,
        "tier0_hit_rate": t.hits / t.routed if t.routed else None,
        "prefetch_hit_rate": t.prefetched / t.routed if t.routed else None,
        "bytes": {"hbm": sizes.hbm_bytes(c), "h2d": sizes.h2d_bytes(t),
                  "h2d_wasted": (t.issued - t.prefetched) * sizes.bytes_per_expert,
                  "disk": sizes.disk_bytes(t)},
        "per_step": _per_step(c, sizes),
        "flops": sizes.flops(c),
        "disk_loads": t.disk_loads,
        "disk_stall_s": t.disk_stall_s,
        "devices": device_figures(c, sizes),
        "counts": c.doc(),
    }
