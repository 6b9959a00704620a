"""Engine statistics, all derived from the records the step returns (docs/design.md, "Stats").

The step reports per layer what it routed and moved; the host adds what it did between steps
(disk loads, cache admissions, rebalancing swaps) and the wall time of each step. The work of
each program call is counted in its phase, decode step or prefill chunk (`PhaseCounts`); the
totals are the two summed. Compilation and warm-up are kept apart: the first call of each
program is counted as compile time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields

import numpy as np

from strata_jax.step import StepRecord

STEP_WINDOW = 4096  # the latest steps that the p50 / p99 are taken over (a server runs for days)
PHASES = ("decode", "prefill")


@dataclass
class PhaseCounts:
    """What the program calls of one phase did: decode steps or prefill chunks. Additive."""

    calls: int = 0
    """Program calls whose record was observed: every decode step (the compiling one too) or
    prefill chunk; a call run again after a disk stall is still one call."""
    routed: int = 0
    """Distinct (layer, expert) routed, summed over the calls."""
    hits: int = 0
    """... of them found in a tier-0 slot."""
    prefetched: int = 0
    """... found in the prefetch half."""
    fetched: int = 0
    """... copied on demand from tier 1 (a stall inside the step)."""
    hosted: int = 0
    """... computed on the host cores instead (EngineConfig.miss)."""
    issued: int = 0
    """Prefetch copies issued."""
    disk_loads: int = 0
    """Tier 2 -> tier 1 reads in the calls' disk stalls."""
    disk_stall_s: float = 0.0
    """Seconds the calls waited on those reads."""
    resumed_layers: int = 0
    """Layers run again after disk stalls (L - l per resume at layer l)."""
    admissions: int = 0
    """Tier 1 -> cache slot copies between calls, made for what the calls routed."""

    def __add__(self, other: PhaseCounts) -> PhaseCounts:
        return PhaseCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                              for f in fields(self)})

    def summary(self) -> dict[str, object]:
        """The calls, each counter's total and its mean per call."""
        names = [f.name for f in fields(self) if f.name != "calls"]
        return {"calls": self.calls,
                "totals": {n: getattr(self, n) for n in names},
                "per_call": {n: getattr(self, n) / self.calls if self.calls else None
                             for n in names}}


def _both(name: str) -> property:
    """A counter of both phases summed (what the engine did, decode and prefill alike)."""
    return property(lambda self: getattr(self.decode, name) + getattr(self.prefill, name),
                    doc=f"`PhaseCounts.{name}` of decode steps and prefill chunks together.")


@dataclass
class EngineStats:
    """Counters since the last reset. Bytes are expert bytes as the slots hold them. The work
    of the program calls is counted per phase (`decode`, `prefill`: written through
    `phase(name)`); `routed`, `disk_loads` and the like are both phases summed."""

    bytes_per_expert: int
    link_gbps: float | None = None  # pinned host -> device, measured at start-up
    decode_steps: int = 0  # timed decode steps (the compiling call of each plan left out)
    decode_tokens: int = 0
    decode_s: float = 0.0  # wall time of the timed decode steps
    recent_steps: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    compile_s: float = 0.0
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    decode: PhaseCounts = field(default_factory=PhaseCounts)
    prefill: PhaseCounts = field(default_factory=PhaseCounts)
    swaps: int = 0  # rebalancing swaps (between decode steps)
    failed_requests: int = 0
    per_layer: dict[str, np.ndarray] = field(default_factory=dict)  # both phases, per layer

    routed = _both("routed")
    hits = _both("hits")
    prefetched = _both("prefetched")
    fetched = _both("fetched")
    hosted = _both("hosted")
    issued = _both("issued")
    disk_loads = _both("disk_loads")
    disk_stall_s = _both("disk_stall_s")
    resumed_layers = _both("resumed_layers")
    admissions = _both("admissions")

    def phase(self, name: str) -> PhaseCounts:
        """The counts of phase `name`: "decode" or "prefill"."""
        if name not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {name!r}")
        return self.decode if name == "decode" else self.prefill

    def step_done(self, seconds: float, tokens: int) -> None:
        """One timed decode step of `tokens` live rows."""
        self.decode_steps += 1
        self.decode_tokens += tokens
        self.decode_s += seconds
        self.recent_steps.append(seconds)

    def observe(self, record: StepRecord, phase: str) -> None:
        """Add one call's record (numpy, read from the device) to phase `phase`."""
        counts = self.phase(phase)
        counts.calls += 1
        routed = (np.asarray(record.counts) > 0).sum(axis=1)
        parts = {"routed": routed, "hits": record.hits, "prefetched": record.prefetched,
                 "fetched": record.fetched, "hosted": record.hosted, "issued": record.issued}
        for name, per_layer in parts.items():
            per_layer = np.asarray(per_layer, np.int64)
            setattr(counts, name, getattr(counts, name) + int(per_layer.sum()))
            self.per_layer[name] = self.per_layer.get(name, 0) + per_layer

    def summary(self) -> dict[str, object]:
        """The figures a user reads: rates, latencies, hit rates, bytes per tier, prediction."""
        t = np.array(self.recent_steps) if self.recent_steps else None
        busy = self.decode_s
        bpe = self.bytes_per_expert
        h2d = (self.fetched + self.issued + self.admissions) * bpe
        out: dict[str, object] = {
            "decode_steps": self.decode_steps,
            "decode_tok_s": self.decode_tokens / busy if busy else None,
            "step_ms_p50": float(np.percentile(t, 50) * 1e3) if t is not None else None,
            "step_ms_p99": float(np.percentile(t, 99) * 1e3) if t is not None else None,
            "compile_s": self.compile_s,
            "prefill_tok_s": self.prefill_tokens / self.prefill_s if self.prefill_s else None,
            "tier0_hit_rate": self.hits / self.routed if self.routed else None,
            "prefetch_hit_rate": self.prefetched / self.routed if self.routed else None,
            "misses_per_step": self.fetched / self.decode_steps if self.decode_steps else None,
            "hosted_per_step": self.hosted / self.decode_steps if self.decode_steps else None,
            "host_bytes": self.hosted * bpe,
            "h2d_bytes": h2d,
            "h2d_wasted_bytes": (self.issued - self.prefetched) * bpe,
            "disk_bytes": self.disk_loads * bpe,
            "disk_loads": self.disk_loads,
            "disk_stall_s": self.disk_stall_s,
            "resumed_layers": self.resumed_layers,
            "admissions": self.admissions,
            "rebalance_swaps": self.swaps,
            "failed_requests": self.failed_requests,
            "link_gbps": self.link_gbps,
            "link_busy": None,
            "prediction": self.prediction(),
            "by_phase": {p: self.phase(p).summary() for p in PHASES},
        }
        if t is not None and self.link_gbps:
            out["link_busy"] = h2d / (self.link_gbps * 1e9) / busy
        if self.hosted and self.decode_steps:  # the split per layer, experts per step
            out["host_split"] = ", ".join(
                f"L{i} {h / self.decode_steps:.2g}/{(h + f) / self.decode_steps:.2g}"
                for i, (h, f) in enumerate(zip(self.per_layer["hosted"],
                                               self.per_layer["fetched"], strict=True)))
        return out

    def prediction(self) -> dict[str, float | None]:
        """Precision (prefetched copies used) and recall (misses prefetched) of the predictor."""
        needed = self.prefetched + self.fetched
        return {"precision": self.prefetched / self.issued if self.issued else None,
                "recall": self.prefetched / needed if needed else None}


def render(summary: dict[str, object], indent: int = 2) -> str:
    """`summary` as an aligned two-column table (a dict of dicts as an indented block)."""
    lines = []
    pad = " " * indent
    for name, value in summary.items():
        if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()):
            lines += [f"{pad}{name}:", render(value, indent + 2)]
            continue
        if isinstance(value, dict):
            value = ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
        lines.append(f"{pad}{name:<{max(22 - indent, 1)}} {_fmt(value)}")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
