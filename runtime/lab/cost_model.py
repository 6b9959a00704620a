"""Hardware profiles and a small decode cost model (docs/design.md, "Traces and the simulator").

One decode step of B live rows takes, in seconds,

    t_hbm     = dense_bytes / dense_read + extra_hbm_bytes / hbm
                + routed * bytes_per_expert / expert_read
    t_compute = B * flops_per_token / matmul
    t_copy    = misses * bytes_per_expert / link          link = min(pcie, host_read)
    t_host    = hosted * bytes_per_expert / host_kernel
    t_unused  = unused * bytes_per_expert / link
    t_admit   = admissions * bytes_per_expert / link
    t_disk    = disk_loads * bytes_per_expert / disk
    d         = (1 - h) * t_copy              the demand copies
    p         = h * t_copy + t_unused         the prefetches
    m         = min(d, p)
    base      = max(d + m, t_host) + max(max(t_hbm, t_compute), p - m) + overhead
    step      = max(base * (1 + rerun) + t_admit + t_disk, t_engine)

and tok/s = B / step. `dense_read` and `expert_read` are the rates at which the model's decode step
without its experts and its expert kernel read their weights at decode rows (the profile's; a plain
read's, `hbm`, where it has none). `routed`, `misses`, `hosted`, `unused`, `admissions` and
`disk_loads` are experts per step (from a replay, `strata_runtime.lab.simulate`, or a run's
counters);
`misses` are copied, `hosted` computed on the host cores at the same time (`EngineConfig.miss`);
`h` is the share of the copied misses prefetched. A layer waits for its demand copies (beside the
host's share: the longer of the two), then reads and computes. The next layer's prefetches, with
those no layer used, are issued as soon as this layer's router gives their ids, so they share the
link with this layer's demand copies (each at half the rate while both run: `m`) and only what is
left of them overlaps the layer's reads and math (docs/design.md, "The cost model"); admissions are
copies between steps (the engine's cache fills, after the step: once per step, however many of its
layers ran again). A step that routes to an expert found only on disk waits for its read (nothing
overlaps it: docs/design.md, "Disk stalls") and runs again from the stalled layer: `rerun` is the
share of a step's layers run again, per step. The binding resource is the one busy longest: hbm
(t_hbm), compute (t_compute), the host kernel (t_host, "host-compute"), the disk (t_disk) or the
link (t_copy + t_unused + t_admit), named "pcie" or "host-read" by the slower of the two, or the
engine (t_engine: its own host work a step, measured by the run, `EngineStats.host_s`, with the
program call where it returns before its program ends, `EngineStats.launch_s`: the host runs
XLA's thunks of a resident step, serial with the engine's own work; a call that blocks while its
program syncs is not in it, and a row whose `engine_dispatch_ms_per_step` nears its step time
names that). Not
modelled: the KV cache read (pass it in `extra_hbm_bytes`) and the gaps between the step's kernels,
both held by a measured `dense_read` (`strata_runtime.lab.kernel_rates.dense_kernel_gbps`), host
round trips (`overhead_s`), the link's and the host kernel's share of DRAM, and layers whose split
is uneven (the step's sums are split, not each layer's).

This module owns every tok/s ceiling, bound and prediction the lab reports: the formula above
(`predict`), fed by a replay (`strata_runtime.lab.simulate.predict_replay`) or by a run's decode
steps (`run_prediction`); the bound of a run's counted bytes and FLOPs over measured ceilings
(`bound`: time >= max(t_hbm, t_compute) + max(t_link, t_host) + t_disk, `serial_seconds`), which
`benchmarks/step_decode.py` also takes its bounds from; the profile of measured ceilings
(`measured_profile`); and a row's time split by term (`time_split`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from strata_jax.formats.config import ModelConfig
from strata_runtime.lab.counting import Counts, Sizes


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """The rates of one machine that the cost model reads."""

    name: str
    """The name `strata simulate --hardware` takes."""
    pcie_gbps: float
    """Pinned host -> device copy rate, GB/s (10^9 bytes/s), expert-sized copies."""
    host_read_gbps: float
    """Host DRAM read rate over all cores, GB/s: a copy's source cannot be read faster."""
    hbm_gbps: float
    """Device memory read rate, GB/s, as a large reduction achieves it."""
    hbm_gib: float
    """Device memory, GiB."""
    matmul_tflops: float
    """Dense matmul rate in the weights' dtype (bf16 / fp16), TFLOP/s."""
    host_cores: int
    """Host cores."""
    host_kernel_gbps: float = 0.0
    """Expert bytes per second the host expert kernel (`strata_jax.ops.host_experts`) reads at
    decode rows, GB/s; 0: no host compute of misses."""
    host_row_cost: float = 0.0
    """Each further row multiplies the host kernel's one-row time by (1 + this)."""
    expert_read_gbps: float = 0.0
    """Expert bytes per second the device's expert kernel reads at decode rows, GB/s (a
    quantized kernel dequantizes as it reads, below the plain read rate); 0: `hbm_gbps`."""
    dense_read_gbps: float = 0.0
    """Dense bytes per second the model's decode step reads without its experts, GB/s: its
    dense matmuls (a matmul of a few rows reads its matrix below the plain read rate), its
    attention and routing among them; 0: `hbm_gbps`."""
    disk_gbps: float = 0.0
    """Expert bytes per second read from tier 2 (the checkpoint on disk) by the engine's fetch
    threads during a stall, GB/s; 0: no disk reads can be modelled."""
    source: str = ""
    """Where the figures come from."""
    reported: str = ""
    """What another system reported on this machine, printed beside the predictions."""

    @property
    def link_gbps(self) -> float:
        return effective_link_gbps(self.pcie_gbps, self.host_read_gbps)


PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (
    HardwareProfile(
        name="h200-pcie5", pcie_gbps=49.0, host_read_gbps=94.0, hbm_gbps=4600.0,
        hbm_gib=139.0, matmul_tflops=700.0, host_cores=16, host_kernel_gbps=45.0,
        host_row_cost=0.05,
        source="measured on the H200 machine (docs/measurements.md, benchmarks/results): "
               "pinned copies 50-54 GB/s alone, 48.9 inside the step; host DRAM 94 GB/s; HBM "
               "read 4.6-4.7 TB/s; bf16 GEMM 685-790 TFLOP/s; 16 cores; the C host expert "
               "kernel (AMX) 43-50 GB/s at one row while copies run (58-94 alone), each "
               "further row +0.03-0.07 (results/host_kernels.md, "
               "results/step_decode_hybrid_2026-12-04.md)"),
    HardwareProfile(
        name="rtx3090-pcie3-xeon-v4", pcie_gbps=12.0, host_read_gbps=150.0, hbm_gbps=936.0,
        hbm_gib=24.0, matmul_tflops=35.0, host_cores=40, host_kernel_gbps=82.0,
        host_row_cost=0.003,
        source="the write-up's machine (the system this project reimplements): PCIe 3.0 "
               "x16 ~12 GB/s real, dual Xeon v4 ~40 cores and ~150 GB/s DDR4, 35 TFLOP/s "
               "fp16; 936 GB/s is the 3090's nominal GDDR6X rate; host kernel assumed 0.55 "
               "of the DRAM rate, the ratio measured on the H200 host (alone)",
        reported="the write-up: ~110 tok/s stable, 127 peak, on its 125 B MoE (int8 shared "
                 "weights, int4 experts, B up to 16)"),
    HardwareProfile(
        name="rtx4090-pcie4", pcie_gbps=25.0, host_read_gbps=60.0, hbm_gbps=1000.0,
        hbm_gib=24.0, matmul_tflops=82.0, host_cores=16, host_kernel_gbps=33.0,
        host_row_cost=0.003,
        source="nominal: PCIe 4.0 x16 ~25 GB/s real, ~1 TB/s GDDR6X, 82 TFLOP/s fp16; host "
               "assumed a 16-core desktop with dual-channel DDR5 (~60 GB/s), its host kernel "
               "0.55 of that (the ratio measured on the H200 host)"),
)}


def effective_link_gbps(pcie_gbps: float, host_read_gbps: float) -> float:
    """The host -> device copy rate: a copy's source cannot be read faster than host DRAM
    gives it."""
    return min(pcie_gbps, host_read_gbps)


def link_name(pcie_gbps: float, host_read_gbps: float) -> str:
    """The link's name by its slower side: "pcie", or "host-read" where host DRAM feeds the
    copies slower than the bus carries them."""
    return "pcie" if pcie_gbps <= host_read_gbps else "host-read"


def profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; shipped: "
                         f"{', '.join(PROFILES)}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelCost:
    """What one decode step of a model reads and computes."""

    bytes_per_expert: int
    """One routed expert as the slots hold it (w1, w3, w2, with scales if quantized)."""
    dense_bytes: int
    """Bytes read from HBM once per step whatever the batch: attention, routers, shared
    experts, norms, the output head (not the embedding table: a step reads B of its rows)."""
    flops_per_token: float
    """Matmul FLOPs of one token: 2 x (dense parameters read + top_k x L x expert params)."""


def model_cost(cfg: ModelConfig, *, dense_bytes_per_param: float = 2.0,
               expert_bytes_per_param: float = 2.0) -> ModelCost:
    """`ModelCost` of a model (bf16 by default; 0.5 + scales for int4 experts, etc.)."""
    counts = cfg.param_counts()
    d, f = cfg.hidden_size, cfg.expert_intermediate_size
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * d
    dense = counts["dense"] - embed
    active = dense + cfg.top_k * cfg.num_layers * 3 * d * f
    return ModelCost(bytes_per_expert=int(3 * d * f * expert_bytes_per_param),
                     dense_bytes=int(dense * dense_bytes_per_param),
                     flops_per_token=2.0 * active)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    """The cost model's answer for one decode step."""

    tok_s: float
    """Predicted decode tokens per second: B / step_s."""
    step_s: float
    """Predicted seconds per decode step."""
    binding: str
    """The resource busy longest: "hbm", "compute", "host-compute", "disk", "pcie" or
    "host-read"."""
    terms: dict[str, float]
    """Seconds per step of each term: t_hbm, t_compute, t_copy, t_host, t_unused, t_admit,
    t_disk."""


def predict(hw: HardwareProfile, model: ModelCost, *, batch: float, routed: float,
            misses: float, admissions: float = 0.0, hidden: float = 0.0,
            hosted: float = 0.0, disk_loads: float = 0.0, rerun: float = 0.0,
            unused: float = 0.0,
            extra_hbm_bytes: float = 0.0, overhead_s: float = 0.0,
            engine_s: float = 0.0) -> Prediction:
    """Decode tok/s by the module docstring's formula; `routed`, `misses` (copied), `hosted`
    (computed on the host), `unused` (prefetches issued that no layer used), `admissions`,
    `disk_loads` (read from disk in a stall) are experts per step, `hidden` the share of the
    copied misses prefetched in time, `rerun` the share of a step's layers run again after
    stalls, `engine_s` the engine's own host seconds a step (it dispatches the next step while
    the device runs this one: the longer of the two paces the loop)."""
    if batch <= 0 or not 0.0 <= hidden <= 1.0 or rerun < 0 or unused < 0:
        raise ValueError(f"need batch > 0, 0 <= hidden <= 1, rerun >= 0 and unused >= 0, got "
                         f"{batch}, {hidden}, {rerun}, {unused}")
    if hosted > 0 and hw.host_kernel_gbps <= 0:
        raise ValueError(f"profile {hw.name} has no host kernel rate: nothing can be hosted")
    if disk_loads > 0 and hw.disk_gbps <= 0:
        raise ValueError(f"profile {hw.name} has no disk rate: disk loads cannot be modelled")
    bpe, link = model.bytes_per_expert, hw.link_gbps * 1e9
    experts, dense = hw.expert_read_gbps or hw.hbm_gbps, hw.dense_read_gbps or hw.hbm_gbps
    terms = {"t_hbm": (model.dense_bytes / (dense * 1e9) + extra_hbm_bytes / (hw.hbm_gbps * 1e9)
                       + routed * bpe / (experts * 1e9)),
             "t_compute": batch * model.flops_per_token / (hw.matmul_tflops * 1e12),
             "t_copy": misses * bpe / link,
             "t_host": hosted * bpe / (hw.host_kernel_gbps * 1e9) if hosted else 0.0,
             "t_unused": unused * bpe / link,
             "t_admit": admissions * bpe / link,
             "t_disk": disk_loads * bpe / (hw.disk_gbps * 1e9) if disk_loads else 0.0}
    demand = (1.0 - hidden) * terms["t_copy"]
    ahead = hidden * terms["t_copy"] + terms["t_unused"]
    shared = min(demand, ahead)  # both on the link, each at half its rate
    base = (max(demand + shared, terms["t_host"])
            + max(terms["t_hbm"], terms["t_compute"], ahead - shared) + overhead_s)
    busy_link = terms["t_copy"] + terms["t_unused"]
    terms["t_engine"] = engine_s
    step = max(base * (1.0 + rerun) + terms["t_admit"] + terms["t_disk"], engine_s)
    busy = {"hbm": terms["t_hbm"], "compute": terms["t_compute"], "engine": engine_s,
            "host-compute": terms["t_host"], "disk": terms["t_disk"],
            link_name(hw.pcie_gbps, hw.host_read_gbps): busy_link + terms["t_admit"]}
    return Prediction(tok_s=batch / step, step_s=step, binding=max(busy, key=busy.get),
                      terms=terms)


# --- a measured run: its profile, its bound, its prediction ----------------------------------


def measured_profile(ceilings: Mapping[str, Any], host_cores: int) -> HardwareProfile:
    """The profile of a run's measured ceilings (`strata_runtime.lab.ceilings`)."""
    return HardwareProfile(
        name="measured", pcie_gbps=ceilings["pinned_h2d_gbps"],
        host_read_gbps=ceilings["host_read_gbps"], hbm_gbps=ceilings["hbm_read_gbps"],
        hbm_gib=ceilings["hbm_gib"], matmul_tflops=ceilings["matmul_tflops"],
        host_cores=host_cores,
        source="measured at the start of this run "
               "(strata_runtime.lab.ceilings.measure_ceilings)")


def bound_link_gbps(ceilings: Mapping[str, Any], step_link: Mapping[str, Any] | None) -> float:
    """The pinned copy rate a run's bound divides by: the faster of the ceiling's and the
    decode steps' own (`kernel_rates.step_link`; None: not measured)."""
    return max(ceilings["pinned_h2d_gbps"] or 0.0, (step_link or {}).get("gbps") or 0.0)


OVERLAPPED = ("hbm", "compute")
"""The bound's terms that overlap each other: the device's reads and its matmuls."""


def serial_seconds(seconds: Mapping[str, float], beside: float = 0.0) -> float:
    """A bound's time from its terms (seconds by name): the longer of the overlapped ones
    ("hbm", "compute"), plus every other term (copies, disk loads and host compute serialize
    with the step that waits for them), less `beside` (seconds of two of those that run side
    by side)."""
    return max(seconds.get("hbm", 0.0), seconds.get("compute", 0.0)) + sum(
        t for k, t in seconds.items() if k not in OVERLAPPED) - beside


def _bound_seconds(c: Counts, sizes: Sizes, ceilings: Mapping[str, Any],
                   disk_gbps: float | None, pcie: float) -> tuple[dict[str, float], float]:
    """The bound's terms and the seconds of its host compute beside the link's copies."""
    host_read = ceilings["host_read_gbps"]
    name = link_name(pcie, host_read)
    seconds = {"hbm": sizes.hbm_bytes(c) / (ceilings["hbm_read_gbps"] * 1e9),
               "compute": sizes.flops(c) / (ceilings["matmul_tflops"] * 1e12),
               name: sizes.busiest_link_bytes(c) / (effective_link_gbps(pcie, host_read) * 1e9)}
    t = c.total
    disk = sizes.disk_bytes(t)
    if disk and disk_gbps:
        seconds["disk"] = disk / (disk_gbps * 1e9)
    beside = 0.0  # the host's misses run beside the link's copies
    if t.hosted:
        seconds["host-compute"] = sizes.hosted_bytes(t) / (host_read * 1e9)
        beside = min(seconds["host-compute"], seconds[name])
    return seconds, beside


def bound(c: Counts, sizes: Sizes, ceilings: Mapping[str, Any], disk_gbps: float | None,
          link_gbps: float | None = None) -> dict[str, Any]:
    """A run's bound from its counted bytes and FLOPs and the measured ceilings
    (`serial_seconds`; `strata_runtime.lab.bench` module docstring); a disk term only where
    disk loads happened and a disk rate was measured. Over several devices the links copy
    side by side: the link term is the busiest device's. `link_gbps`: the fastest pinned copy
    rate measured (default: the ceiling's)."""
    pcie = link_gbps or ceilings["pinned_h2d_gbps"]
    seconds, beside = _bound_seconds(c, sizes, ceilings, disk_gbps, pcie)
    serial = serial_seconds(seconds, beside)
    roof = max(seconds.values())
    disk = sizes.disk_bytes(c.total)
    return {"seconds": seconds, "bound_s": serial,
            "bound_tok_s": c.new_tokens / serial if serial > 0 else None,
            "roofline_tok_s": c.new_tokens / roof if roof > 0 else None,
            "ratio": serial / c.wall_s if c.wall_s > 0 and serial > 0 else None,
            "binds": max(seconds, key=seconds.get),
            "disk_unbounded": bool(disk and not disk_gbps)}


def _with_disk_rate(c: Counts, sizes: Sizes, hw: HardwareProfile) -> HardwareProfile:
    """`hw`, given the rate the decode steps' disk loads achieved where it has none (every
    call's, if the decode stalls took no measurable time)."""
    d = c.decode
    if not d.disk_loads or hw.disk_gbps > 0:
        return hw
    loads = d if d.disk_stall_s > 0 else c.total
    if loads.disk_stall_s <= 0:
        return hw
    return dataclasses.replace(hw, disk_gbps=sizes.disk_bytes(loads) / loads.disk_stall_s / 1e9)


def _decode_inputs(c: Counts, sizes: Sizes, hw: HardwareProfile,
                   layers: int) -> dict[str, float]:
    """`predict`'s per-step inputs from the decode steps' counters (`run_prediction`)."""
    d = c.decode
    disk = d.disk_loads if hw.disk_gbps > 0 else 0
    need = d.fetched + d.prefetched
    steps = d.calls
    return {"batch": c.decode_tokens / c.decode_steps, "routed": d.routed / steps,
            "misses": need / steps, "hosted": d.hosted / steps,
            "admissions": d.admissions / steps, "disk_loads": disk / steps,
            "unused": max(d.issued - d.prefetched, 0) / steps,
            "rerun": d.resumed_layers / (layers * steps) if disk else 0.0,
            "engine_s": (c.host_s + c.launch_s) / c.decode_steps,
            "hidden": d.prefetched / need if need else 0.0,
            # a measured dense rate has the attention's cache reads in it already
            "extra_hbm_bytes": 0.0 if hw.dense_read_gbps else float(sizes.kv_bytes)}


def run_prediction(c: Counts, sizes: Sizes, hw: HardwareProfile,
                   layers: int) -> dict[str, Any] | None:
    """The cost model's decode tok/s from a run's decode steps (None: no decode step).
    Inputs, from the decode steps' counters alone (`Counts.decode`; prefill chunks route and
    stall on disk far more, and the decode tok/s it is compared with leaves them out): batch =
    live rows per timed decode step; routed, misses (demand copies + prefetched experts: every
    routed expert without a tier-0 slot), hosted, admissions, disk loads per decode step;
    hidden = the misses' share the prefetch served; rerun = the share of a step's `layers` run
    again after disk stalls; extra_hbm_bytes = the KV cache (none with a measured dense rate,
    `kernel_rates.dense_kernel_gbps`, whose program reads the cache). Unless the profile has a
    disk rate, disk loads count at the rate the decode steps' own loads achieved (their bytes /
    their stall seconds; every call's, if the decode stalls took no measurable time): how much
    of the checkpoint the page cache holds and how many loads a stall overlaps decide it,
    which no ceiling measured apart knows; unused = the prefetches issued that no layer
    used (they hold the link)."""
    if not c.decode_steps or not c.decode.calls:
        return None
    hw = _with_disk_rate(c, sizes, hw)
    inputs = _decode_inputs(c, sizes, hw, layers)
    model = ModelCost(bytes_per_expert=sizes.bytes_per_expert, dense_bytes=sizes.dense_bytes,
                      flops_per_token=sizes.flops_per_token)
    p = predict(hw, model, **inputs)
    return {"profile": hw.name, "tok_s": p.tok_s, "binding": p.binding, "step_ms": 1e3 * p.step_s,
            "terms_ms": {k: 1e3 * v for k, v in p.terms.items()},
            "inputs": {**inputs, "bytes_per_expert": sizes.bytes_per_expert,
                       "dense_bytes": sizes.dense_bytes,
                       "flops_per_token": sizes.flops_per_token,
                       "disk_gbps": hw.disk_gbps if inputs["disk_loads"] else None,
                       "expert_read_gbps": hw.expert_read_gbps or None,
                       "dense_read_gbps": hw.dense_read_gbps or None,
                       "link_gbps": hw.link_gbps},
            "compare_with": "decode_tok_s"}


def pooled(p: dict[str, Any] | None) -> dict[str, Any] | None:
    """A prediction from the repeats' summed counts, to be read against the decode tok/s of
    the same sums (every repeat's decode tokens / their decode seconds), not the median."""
    return None if p is None else {**p, "compare_with": "decode_tok_s_pooled"}


def prediction_error(row: Mapping[str, Any]) -> float | None:
    """predicted / measured - 1 for a row (a repeat's or a summary), by its `compare_with`."""
    p = row.get("predicted")
    measured = None if p is None else row.get(p["compare_with"])
    if isinstance(measured, dict):
        measured = measured.get("median")
    return None if not measured else p["tok_s"] / measured - 1


def time_split(row: Mapping[str, Any]) -> dict[str, float]:
    """A bench summary row's engine ms per program call, split in the order the stats can
    vouch for them: disk stalls (measured), then estimates each capped by what is left:
    host->device copies (counted bytes / the link), the routed experts' reads (their counted
    bytes / the expert kernel's rate: an int4 kernel's dequant is in it), the rest of the
    step's reads (dense bytes and KV cache / the rate of the step without experts, or the
    device read), and the rest (measured minus all those: routing, sampling, host round trips,
    gaps)."""
    per, sizes, ceil = row["per_step"], row["sizes"], row["ceilings"]
    link = effective_link_gbps(ceil["pinned_h2d_gbps"], ceil["host_read_gbps"])
    dense_gb = (sizes["dense_bytes"] + sizes["kv_bytes"]) / 1e9
    left = per["ms_engine"]
    split = {"disk": min(per["ms_disk_stall"], left)}
    left -= split["disk"]
    estimates = {
        "copies": 1e3 * per["h2d_GB"] / link,
        "experts": 1e3 * max(per["hbm_GB"] - dense_gb, 0.0)
        / (row.get("expert_read_gbps") or ceil["hbm_read_gbps"]),
        "dense": 1e3 * min(per["hbm_GB"], dense_gb)
        / (row.get("dense_read_gbps") or ceil["hbm_read_gbps"])}
    for name, ms in estimates.items():
        split[name] = min(ms, left)
        left -= split[name]
    split["rest"] = left
    return split
