"""Engine statistics, all derived from the records the step returns (docs/design.md, "Stats").

The step reports per layer what it routed and moved; the host adds what it did between steps
(disk loads, cache admissions, rebalancing swaps, reads ahead) and the wall time of each step.
The work of each program call is counted in its phase, decode step or prefill chunk
(`PhaseCounts`); the totals are the two summed. Compilation and warm-up are kept apart: the
first call of each program is counted as compile time.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field, fields

import numpy as np

from strata_jax.step.programs import PER_DEVICE, StepRecord

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


@dataclass
class DeviceCounts:
    """What one device of the expert axis did in both phases: the record's counters of its own
    experts (`step.PER_DEVICE`) and the host's moves into its tiers."""

    device: str
    link_gbps: float | None = None
    """Its pinned host -> device rate, measured at start-up."""
    hits: int = 0
    prefetched: int = 0
    fetched: int = 0
    issued: int = 0
    admissions: int = 0
    disk_loads: int = 0

    def __add__(self, other: DeviceCounts) -> DeviceCounts:
        """The counts of both runs of the same device."""
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
            if f.name not in ("device", "link_gbps")})

    def h2d_bytes(self, bytes_per_expert: int) -> int:
        """Expert bytes over its link: demand copies, prefetches issued, cache admissions."""
        return (self.fetched + self.issued + self.admissions) * bytes_per_expert

    def summary(self, bytes_per_expert: int, busy: float) -> dict[str, object]:
        """Its counters, link bytes and link busy share over `busy` decode seconds."""
        h2d = self.h2d_bytes(bytes_per_expert)
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "h2d_bytes": h2d,
                "disk_bytes": self.disk_loads * bytes_per_expert,
                "link_busy": h2d / (self.link_gbps * 1e9) / busy
                if busy and self.link_gbps else None}


def _both(name: str) -> property:
    """A counter of both phases summed (what the engine did, decode and prefill alike)."""
    return property(lambda self: getattr(self.decode, name) + getattr(self.prefill, name),
                    doc=f"`PhaseCounts.{name}` of decode steps and prefill chunks together.")


@dataclass
class EngineStats:
    """Counters since the last reset. Bytes are expert bytes as the slots hold them. The work
    of the program calls is counted per phase (`decode`, `prefill`: written through
    `phase(name)`); `routed`, `disk_loads` and the like are both phases summed. Over an
    expert axis each device's share is also counted apart (`devices`)."""

    bytes_per_expert: int
    link_gbps: float | None = None  # pinned host -> the first device, measured at start-up
    devices: list[DeviceCounts] = field(default_factory=list)  # one per device
    decode_steps: int = 0  # timed decode steps (the compiling call of each plan left out)
    decode_tokens: int = 0
    decode_s: float = 0.0  # wall time of the timed decode steps
    host_s: float = 0.0  # the engine's own host work in its timed decode steps: the program
    # call and the waits for a step's record left out
    dispatch_s: float = 0.0  # ... the program calls (a call blocks while its program syncs)
    launch_s: float = 0.0  # ... of which the calls that return before their program ends (no
    # staging loops, no disk: a resident step), the host running XLA's thunks for it: host time
    # as serial with the engine's own as host_s is (docs/design.md, "The cost model")
    wait_s: float = 0.0  # ... the waits for a step's record
    recent_steps: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    compile_s: float = 0.0
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    ridden_tokens: int = 0  # decode tokens drawn by rows riding along prefill programs
    decode: PhaseCounts = field(default_factory=PhaseCounts)
    prefill: PhaseCounts = field(default_factory=PhaseCounts)
    swaps: int = 0  # rebalancing swaps (between decode steps)
    read_ahead: int = 0  # tier 2 -> tier 1 reads ahead of need (between decode steps)
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

    def fresh(self) -> EngineStats:
        """Zeroed counters of the same engine (its sizes, devices and link rates)."""
        return EngineStats(self.bytes_per_expert, link_gbps=self.link_gbps,
                           devices=[DeviceCounts(d.device, d.link_gbps) for d in self.devices])

    def moved(self, phase: str, name: str, device: int) -> None:
        """One more host-side move `name` ("admissions", "disk_loads") in `phase`, into the
        tiers of device `device`."""
        counts = self.phase(phase)
        setattr(counts, name, getattr(counts, name) + 1)
        if self.devices:
            setattr(self.devices[device], name, getattr(self.devices[device], name) + 1)

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
        for name, value in parts.items():
            by_device = np.asarray(value, np.int64).reshape(len(routed), -1)  # [L, n] or [L, 1]
            per_layer = by_device.sum(axis=1)
            setattr(counts, name, getattr(counts, name) + int(per_layer.sum()))
            self.per_layer[name] = self.per_layer.get(name, 0) + per_layer
            if name in PER_DEVICE and self.devices:
                for device, n in zip(self.devices, by_device.sum(axis=0), strict=True):
                    setattr(device, name, getattr(device, name) + int(n))

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
            "host_ms_per_step": (1e3 * self.host_s / self.decode_steps
                                 if self.decode_steps else None),
            "dispatch_ms_per_step": (1e3 * self.dispatch_s / self.decode_steps
                                     if self.decode_steps else None),
            "wait_ms_per_step": (1e3 * self.wait_s / self.decode.calls
                                 if self.decode.calls else None),
            "prefill_tok_s": self.prefill_tokens / self.prefill_s if self.prefill_s else None,
            "ridden_tokens": self.ridden_tokens,
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
            "read_ahead_loads": self.read_ahead,
            "read_ahead_bytes": self.read_ahead * bpe,
            "failed_requests": self.failed_requests,
            "link_gbps": self.link_gbps,
            "link_busy": None,
            "prediction": self.prediction(),
            "by_phase": {p: self.phase(p).summary() for p in PHASES},
            "devices": [d.summary(bpe, busy if t is not None else 0.0) for d in self.devices],
        }
        busy_links = [d["link_busy"] for d in out["devices"] if d["link_busy"] is not None]
        if busy_links:  # the busiest link: the one a step waits for
            out["link_busy"] = max(busy_links)
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
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines += [f"{pad}{name}:", render({str(i): v for i, v in enumerate(value)},
                                              indent + 2)]
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
