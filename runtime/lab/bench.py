"""`strata bench`: repeated, fingerprinted throughput runs of the offload engine, each beside
its bound and the cost model's prediction (docs/design.md, "Benchmarks and sweeps").

One bench: a fresh `Engine` from the checkpoint and an `EngineConfig`; `prompts` synthetic
prompts of `prompt_len` ids drawn from the seed; a warm-up `generate` of the same prompts and
length timed apart (it compiles prefill and decode, and the helpers that only a disk stall, a
cache admission or a rebalancing calls, which a short warm-up may not meet), then `repeats`
timed `generate` calls, the engine's counters reset before each (placement, cache, tier 1 and
heat are kept: the timed runs see the warm-up's state). Greedy decoding with no stop ids, so
every request yields exactly `new` tokens and the same seed gives the same tokens.

Per repeat: tok/s = generated tokens / wall seconds of the timed `generate` (prefill, decode and
the scheduler's host work), the engine's decode-only tok/s, step p50 / p99, hit rates, and the
bytes and FLOPs the run's counters give (`counting`):
  - HBM: per program call (decode step or prefill chunk) the dense params but the embedding
    table, the KV cache (decode: every row's `max_len` positions; a prefill chunk: its row's),
    and every distinct routed expert (bytes as the slots hold them);
  - host -> device: demand copies + prefetches issued + cache admissions (`EngineStats`);
    over several devices (`EngineConfig.expert_devices`) also each device's own, with its
    rate over the engine's time and the share of its link that is (`device_figures`), and
    the bound's link term is the busiest device's (the links copy side by side);
  - disk: disk loads x bytes per expert;
  - host compute: misses computed on the host cores (`EngineConfig.miss`) x bytes per
    expert, read at the host's DRAM rate;
  - FLOPs: 2 x active parameters x (prompt + generated tokens) (`cost_model.model_cost`;
    attention's own math left out).
The bound (`cost_model.bound`) divides each by its ceiling, measured once at the start of a run
(`ceilings.measure_ceilings`): time >= max(t_hbm, t_compute) + max(t_link, t_host) + t_disk,
since the engine's copies and disk loads serialize with the step that waits for them (the host's
share of the misses beside the copies) while HBM reads and matmuls overlap; bound tok/s =
generated tokens / that time, `ratio` = measured / bound (1.0: at the ceiling), `binds` = the
largest term. `roofline_tok_s` is the looser bound with every term overlapped (max of all).

The cost model (`cost_model.predict`) predicts decode tok/s from the decode steps' counters
(the engine counts decode steps and prefill chunks apart) as means per decode step
(`cost_model.run_prediction`), on the ceilings measured in the run (profile "measured") or a
shipped profile; compare it with the engine's decode tok/s, which leaves prefill out too. With
the measured profile the routed experts' bytes count at the rate the engine's own expert kernel
reads them (`kernel_rates.expert_kernel_gbps`, timed on the engine's pool after its warm-up, as
many experts as a layer of it routed: a quantized kernel dequantizes as it reads, below the plain
read), and the dense bytes at the rate of the model's own decode step without its experts
(`kernel_rates.dense_kernel_gbps`: a matmul of a few rows reads below a plain read, and the
step's small kernels leave gaps); the bound keeps the plain read. Its link is the one the decode
steps use (`kernel_rates.step_link`: as many experts as a layer copied in the warm-up, by the
step's own copy out of the engine's tier 1), which the bound uses too where it is faster than the
ceiling's.

The median's 95 % interval is a percentile bootstrap of the median over the repeats (10,000
resamples drawn from the bench seed): it cannot be wider than the repeats' range, so it is
narrow for few repeats (use 5 or more).

The parts: `ceilings` measures the machine and `fingerprint` names it; `facts` reads the engine
(`EngineFacts`: no other part reads its attributes), `kernel_rates` times its kernels,
`counting` turns its counters into bytes and FLOPs, `cost_model` makes the bound and the
prediction of those; this module runs the engine and writes the rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from strata_jax.formats.checkpoint import CheckpointReader
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.lab.ceilings import CHAIN as CHAIN
from strata_runtime.lab.ceilings import GPU_WARM_S as GPU_WARM_S
from strata_runtime.lab.ceilings import (
    best_seconds,
    checkpoint_disk_gbps,
    device_read_gbps,
    matmul_tflops,
    measure_ceilings,
)
from strata_runtime.lab.ceilings import disk_read_gbps as disk_read_gbps
from strata_runtime.lab.ceilings import drop_page_cache as drop_page_cache
from strata_runtime.lab.cost_model import (
    HardwareProfile,
    bound,
    bound_link_gbps,
    measured_profile,
    pooled,
    prediction_error,
    profile,
    run_prediction,
)
from strata_runtime.lab.counting import Counts, figures, routed_gbps
from strata_runtime.lab.facts import EngineFacts
from strata_runtime.lab.fingerprint import git_commit as git_commit
from strata_runtime.lab.fingerprint import hardware_fingerprint
from strata_runtime.lab.kernel_rates import dense_kernel_gbps as dense_kernel_gbps
from strata_runtime.lab.kernel_rates import engine_step_link, kernel_rates

LEVEL = 0.95
RESAMPLES = 10_000
INTERVAL_METHOD = (f"percentile bootstrap of the median over the repeats ({RESAMPLES} "
                   "resamples, seeded by the bench seed)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """What one bench runs besides the engine's knobs (`strata bench` flags, sweep keys)."""

    prompts: int = 8
    """Synthetic prompts per timed run (continuous batching over `batch_capacity` rows)."""
    prompt_len: int = 16
    """Ids per prompt."""
    new: int = 32
    """Tokens generated per prompt."""
    repeats: int = 5
    """Timed runs after the warm-up."""
    warmup_new: int = 0
    """Tokens per prompt of the warm-up run; 0: `new`. The same prompts go through it, so it
    compiles every program the timed runs call (their prefill chunks, the decode step) with
    any count; a full-length one also leaves the caches as the timed runs leave them."""
    seed: int = 0
    """Draws the prompts (and the bootstrap's resamples)."""
    hardware: str = "measured"
    """The cost model's profile: "measured" (this run's ceilings) or a shipped profile."""

    def __post_init__(self) -> None:
        for name in ("prompts", "prompt_len", "new", "repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.warmup_new, int) or self.warmup_new < 0:
            raise ValueError(f"warmup_new must be an integer >= 0, got {self.warmup_new!r}")
        if self.hardware != "measured":
            profile(self.hardware)  # a ValueError naming the shipped ones

    @property
    def measured(self) -> bool:
        """Whether the cost model reads this run's own rates (profile "measured")."""
        return self.hardware == "measured"


def synthetic_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` ids in [3, vocab), a pure function of its arguments."""
    rng = np.random.default_rng(seed)
    return [rng.integers(min(3, vocab - 1), vocab, length).tolist() for _ in range(count)]


def median_interval(values: list[float], seed: int = 0, level: float = LEVEL,
                    resamples: int = RESAMPLES) -> dict[str, Any]:
    """The median of `values` and its percentile-bootstrap interval at `level` (widened to
    contain the median, which resampling cannot leave out for an odd count)."""
    v = np.asarray(values, np.float64)
    med = float(np.median(v))
    if len(v) < 2:
        lo = hi = med
    else:
        idx = np.random.default_rng(seed).integers(0, len(v), (resamples, len(v)))
        meds = np.median(v[idx], axis=1)
        lo, hi = (float(x) for x in np.percentile(meds, [50 * (1 - level), 50 * (1 + level)]))
    return {"median": med, "lo": min(lo, med), "hi": max(hi, med), "level": level,
            "method": INTERVAL_METHOD, "values": [float(x) for x in v]}


def config_doc(config: EngineConfig) -> dict[str, Any]:
    """`config` as JSON values (nested dataclasses as dicts)."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def tokens_digest(tokens: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()


def check_fits(config: EngineConfig, settings: BenchSettings) -> None:
    need = settings.prompt_len + settings.new
    if need > config.max_len:
        raise ValueError(f"prompt_len {settings.prompt_len} + new {settings.new} = {need} "
                         f"positions do not fit max_len {config.max_len}: raise max_len "
                         "(--max-len) or shorten the run")


# --- running --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """The JSON rows of a bench (one per repeat, then the summary) and the tokens of each
    repeat."""

    rows: list[dict[str, Any]]
    tokens: list[list[list[int]]]

    @property
    def summary(self) -> dict[str, Any]:
        return self.rows[-1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Bench:
    """What every part of one bench reads."""

    config: EngineConfig
    settings: BenchSettings
    reader: CheckpointReader
    prompts: list[list[int]]
    ceilings: dict[str, Any]
    """The machine's rates (`measure_ceilings`); the checkpoint's disk rate is added to it."""
    fingerprint: dict[str, Any]
    head: dict[str, Any]
    """The first keys of every row."""

    def disk_gbps(self, c: Counts) -> float | None:
        """The checkpoint's disk rate where `c` loaded from disk (`checkpoint_disk_gbps`)."""
        if not c.total.disk_loads:
            return None
        return checkpoint_disk_gbps(self.ceilings, self.reader, self.config.fetch_threads)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Warm:
    """What the warm-up run leaves the timed runs."""

    hw: HardwareProfile
    """The cost model's profile, with the engine's own rates where it is "measured"."""
    link_gbps: float
    """The pinned copy rate the bound divides by (`cost_model.bound_link_gbps`)."""
    doc: dict[str, Any]
    """The summary's warm-up keys: its seconds, compile seconds, kernel rates, step link."""


@dataclasses.dataclass(kw_only=True)
class _Repeats:
    """The timed runs so far: each one's row, tokens, counts; every decode step's seconds."""

    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tokens: list[list[list[int]]] = dataclasses.field(default_factory=list)
    counts: list[Counts] = dataclasses.field(default_factory=list)
    steps_s: list[float] = dataclasses.field(default_factory=list)


def _start_profile(bench: _Bench, facts: EngineFacts) -> HardwareProfile:
    """The cost model's profile before the warm-up: the run's ceilings or a shipped profile,
    given the engine's host kernel rates where it computes misses on the host and the profile
    has none."""
    settings, rates = bench.settings, facts.host_rates
    hw = (measured_profile(bench.ceilings, int(bench.fingerprint.get("host_cores") or 0))
          if settings.measured else profile(settings.hardware))
    if rates is not None and hw.host_kernel_gbps <= 0:  # the engine's own
        hw = dataclasses.replace(hw, host_kernel_gbps=rates.host_gbps,
                                 host_row_cost=rates.row_cost)
    return hw


def _warm_up(bench: _Bench, engine: Engine, facts: EngineFacts) -> _Warm:
    """Run the warm-up (it compiles every program), then time the engine's own kernels and
    step link where the profile is "measured"."""
    settings = bench.settings
    hw = _start_profile(bench, facts)
    t0 = time.perf_counter()
    engine.generate(bench.prompts, settings.warmup_new or settings.new)  # compiles them all
    warmup_s = time.perf_counter() - t0
    compile_s = engine.stats()["compile_s"]
    errors: dict[str, str] = {}
    experts = link = None
    if settings.measured:  # the rates of this engine's own kernels
        hw, experts, errors = kernel_rates(facts, hw)
        link = engine_step_link(facts)
    if link is not None:
        hw = dataclasses.replace(hw, pcie_gbps=link["gbps"])
    doc = {"warmup_s": warmup_s, "compile_s": compile_s, "expert_read_experts": experts,
           "step_link": link, "kernel_rate_errors": errors}
    return _Warm(hw=hw, link_gbps=bound_link_gbps(bench.ceilings, link), doc=doc)


def _repeat(bench: _Bench, engine: Engine, facts: EngineFacts, warm: _Warm, r: int,
            done: _Repeats) -> dict[str, Any]:
    """Timed run `r` (the counters reset after it), its row added to `done`."""
    t0 = time.perf_counter()
    out = engine.generate(bench.prompts, bench.settings.new)
    wall = time.perf_counter() - t0
    stats = engine.stats()  # observes the last step's record first
    c = Counts.of(facts.counters(), wall, sum(len(t) for t in out))
    run_steps = list(facts.counters().recent_steps)
    engine.reset_stats()
    sizes = facts.sizes
    row = {"kind": "repeat", **bench.head, "repeat": r, **figures(c, sizes, run_steps),
           "bound": bound(c, sizes, bench.ceilings, bench.disk_gbps(c), warm.link_gbps),
           "predicted": run_prediction(c, sizes, warm.hw, facts.cfg.num_layers),
           "tokens_sha256": tokens_digest(out),
           "stats": stats, "fingerprint": bench.fingerprint}
    done.rows.append(row)
    done.tokens.append(out)
    done.counts.append(c)
    done.steps_s += run_steps
    return row


def _summary(bench: _Bench, facts: EngineFacts, warm: _Warm, build_s: float,
             done: _Repeats) -> dict[str, Any]:
    """The summary row of the timed runs: medians and intervals over the repeats, the bound
    and the prediction of their summed counts."""
    settings, rows, counts, sizes = bench.settings, done.rows, done.counts, facts.sizes
    total = sum(counts, Counts())
    figs = figures(total, sizes, done.steps_s)
    per_repeat = {k: median_interval([r[k] for r in rows], settings.seed)
                  for k in ("tok_s", "decode_tok_s", "prefill_tok_s")
                  if all(r[k] is not None for r in rows)}
    b = bound(total, sizes, bench.ceilings, bench.disk_gbps(total), warm.link_gbps)
    tok = per_repeat["tok_s"]["median"]
    b["ratio"] = tok / b["bound_tok_s"] if b["bound_tok_s"] else None  # of the median
    errors, hw = warm.doc["kernel_rate_errors"], warm.hw
    return {
        "kind": "summary", **bench.head, "repeats": settings.repeats,
        "settings": dataclasses.asdict(settings), "config": config_doc(bench.config),
        "tok_s": per_repeat["tok_s"], "decode_tok_s": per_repeat.get("decode_tok_s"),
        "prefill_tok_s": per_repeat.get("prefill_tok_s"),
        "prefill_h2d_MB_per_token": figs["prefill_h2d_MB_per_token"],
        "prefill_ms_per_prompt": 1e3 * total.prefill_s / settings.repeats / len(bench.prompts),
        "prefill_chunk": facts.prefill_chunk,
        **{k: figs[k] for k in ("step_ms_p50", "step_ms_p99", "tier0_hit_rate",
                                "prefetch_hit_rate", "bytes", "per_step", "flops", "devices")},
        "disk_loads": float(np.median([c.total.disk_loads for c in counts])),
        "disk_stall_s": float(np.median([c.total.disk_stall_s for c in counts])),
        "decode_tok_s_pooled": (total.decode_tokens / total.decode_s
                                if total.decode_s > 0 else None),
        "engine_host_ms_per_step": (1e3 * total.host_s / total.decode_steps
                                    if total.decode_steps else None),
        "engine_dispatch_ms_per_step": (1e3 * total.dispatch_s / total.decode_steps
                                        if total.decode_steps else None),
        "routed_gbps": routed_gbps(total, sizes),
        "bound": b, "predicted": pooled(run_prediction(total, sizes, hw, facts.cfg.num_layers)),
        "expert_read_gbps": hw.expert_read_gbps or None,
        "expert_read_experts": warm.doc["expert_read_experts"],
        "dense_read_gbps": hw.dense_read_gbps or None, "step_link": warm.doc["step_link"],
        **({"kernel_rate_errors": errors} if errors else {}),
        "ceilings": bench.ceilings,
        "sizes": dataclasses.asdict(sizes), "build_s": build_s,
        "build_phases_s": facts.startup, "warmup_s": warm.doc["warmup_s"],
        "compile_s": warm.doc["compile_s"], "tokens_sha256": rows[0]["tokens_sha256"],
        "tokens_equal_across_repeats": all(t == done.tokens[0] for t in done.tokens),
        "numa": rows[0]["stats"].get("numa"), "fingerprint": bench.fingerprint,
    }


def _prepare(ckpt: str | os.PathLike, config: EngineConfig, settings: BenchSettings,
             ceilings: dict[str, Any] | None, fingerprint: dict[str, Any] | None,
             label: str | None) -> _Bench:
    """The bench's inputs: the checkpoint, the prompts, the ceilings and the fingerprint
    (measured unless given)."""
    check_fits(config, settings)
    reader = CheckpointReader(ckpt)
    prompts = synthetic_prompts(reader.config.vocab_size, settings.prompts,
                                settings.prompt_len, settings.seed)
    ceilings = measure_ceilings() if ceilings is None else ceilings
    if fingerprint is None:
        fingerprint = hardware_fingerprint(ceilings["pinned_h2d_gbps"])
    return _Bench(config=config, settings=settings, reader=reader, prompts=prompts,
                  ceilings=ceilings, fingerprint=fingerprint,
                  head={"label": label, "checkpoint": str(reader.path), "seed": settings.seed})


def run_bench(ckpt: str | os.PathLike, config: EngineConfig, settings: BenchSettings, *,
              ceilings: dict[str, Any] | None = None,
              fingerprint: dict[str, Any] | None = None, label: str | None = None,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> BenchResult:
    """Warm-up apart, `settings.repeats` timed runs of a fresh engine (module docstring).
    `ceilings` and `fingerprint` are measured unless given (a sweep measures them once);
    `on_row` sees each row as it is made."""
    bench = _prepare(ckpt, config, settings, ceilings, fingerprint, label)
    done = _Repeats()
    t0 = time.perf_counter()
    with Engine(bench.reader, config) as engine:
        build_s = time.perf_counter() - t0
        facts = EngineFacts.of(engine)
        warm = _warm_up(bench, engine, facts)
        engine.reset_stats()
        for r in range(settings.repeats):
            row = _repeat(bench, engine, facts, warm, r, done)
            if on_row is not None:
                on_row(row)
    summary = _summary(bench, facts, warm, build_s, done)
    if on_row is not None:
        on_row(summary)
    return BenchResult([*done.rows, summary], done.tokens)


# --- output ---------------------------------------------------------------------------------


def _over(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _f(value: object, fmt: str = ".4g") -> str:
    return "-" if value is None else format(value, fmt)


def interval_text(iv: dict[str, Any] | None, fmt: str = ".4g") -> str:
    if iv is None:
        return "-"
    return f"{iv['median']:{fmt}} [{iv['lo']:{fmt}}, {iv['hi']:{fmt}}]"


def _run_lines(s: dict[str, Any]) -> list[str]:
    """The summary's lines of what ran and where: settings, machine, rates, bytes."""
    st, c, fp, per = s["settings"], s["ceilings"], s["fingerprint"], s["per_step"]
    return [
        f"{s['checkpoint']}: {st['prompts']} prompts x {st['prompt_len']} ids, {st['new']} new "
        f"tokens each, {s['repeats']} repeats, seed {s['seed']}; warm-up {s['warmup_s']:.2f} s "
        f"apart (compile {s['compile_s']:.2f} s), engine built in {s['build_s']:.2f} s",
        f"machine: {fp['gpu']} ({fp['device_kind']}), jax {fp['jax']}, {fp['host_cores']} "
        f"cores, NUMA nodes {_f(fp['numa_nodes'])}, PCIe gen {fp['pcie_gen'] or '-'}, commit "
        f"{(fp['git'] or {}).get('commit', '-')[:12]}",
        f"tok/s (generated / wall of the timed generate): {interval_text(s['tok_s'])} "
        f"(median [{s['tok_s']['level']:.0%} interval: {s['tok_s']['method']}])",
        f"decode tok/s (engine, decode steps only):     {interval_text(s['decode_tok_s'])}",
        f"prefill tok/s (engine, prefill chunks only):  {interval_text(s.get('prefill_tok_s'))}"
        f" in {_f(s.get('prefill_chunk'))}-token chunks; {_f(s.get('prefill_ms_per_prompt'))} "
        f"ms of prefill per prompt; {_f(s.get('prefill_h2d_MB_per_token'))} MB copied to the "
        "device per prompt token",
        f"step ms p50 / p99 (every timed decode step):  {_f(s['step_ms_p50'])} / "
        f"{_f(s['step_ms_p99'])}; the engine's own host work {_f(s['engine_host_ms_per_step'])}"
        f" ms a step, its program call {_f(s['engine_dispatch_ms_per_step'])} ms",
        f"hit rates: tier 0 {_f(s['tier0_hit_rate'], '.3f')}, prefetched "
        f"{_f(s['prefetch_hit_rate'], '.3f')}",
        f"per program call (decode step or prefill chunk): HBM {per['hbm_GB']:.4g} GB, "
        f"host->device {per['h2d_GB']:.4g} GB, disk {per['disk_GB']:.4g} GB; disk stalls "
        f"{s['disk_stall_s']:.3g} s ({s['disk_loads']:g} loads) per repeat",
        f"per decode step: disk {per['decode_disk_GB']:.4g} GB, disk stalls "
        f"{per['decode_ms_disk_stall']:.4g} ms",
        f"routed experts (decode): {_f(s.get('routed_gbps'))} GB/s effective = "
        f"{_f(_over(s.get('routed_gbps'), c['pinned_h2d_gbps']), '.3g')}x the link, "
        f"{_f(_over(s.get('routed_gbps'), c['host_read_gbps']), '.3g')}x host DRAM reads",
    ]


def _bound_lines(s: dict[str, Any]) -> list[str]:
    """The summary's lines of the ceilings and the bound."""
    c, b = s["ceilings"], s["bound"]
    return [
        f"ceilings (measured at start): pinned h2d {c['pinned_h2d_gbps']:.3g} GB/s, host read "
        f"{c['host_read_gbps']:.3g} GB/s, device read {c['hbm_read_gbps']:.4g} GB/s, matmul "
        f"{c['matmul_tflops']:.3g} TFLOP/s ({c['matmul_dtype']})"
        + ("; disk (cold / warm) " + ", ".join(f"{v['cold']:.3g} / {v['warm']:.3g}"
                                               for v in c["disk_read_gbps"].values()) + " GB/s"
           if c.get("disk_read_gbps") else ""),
        f"bound (counted bytes and FLOPs / ceilings): {_f(b['bound_tok_s'])} tok/s, measured "
        f"{_f(b['ratio'], '.3f')} of it, binds: {b['binds']}"
        + (" (disk reads not bounded: no disk rate)" if b["disk_unbounded"] else ""),
    ]


def _model_lines(s: dict[str, Any]) -> list[str]:
    """The summary's lines of each device's link, the kernel rates and the cost model."""
    p, lines = s["predicted"], []
    if len(s["devices"]) > 1:
        lines += [f"device {d['device']}: host->device {d['h2d_GB_per_step']:.4g} GB per "
                  f"call, {_f(d['h2d_gbps'])} GB/s over the engine's time (link "
                  f"{_f(d['link_gbps'], '.3g')} GB/s, busy {_f(d['link_busy'], '.3f')}); "
                  f"{d['fetched']} copied, {d['issued']} prefetched, {d['admissions']} "
                  f"admitted, {d['disk_loads']} disk loads" for d in s["devices"]]
    if s.get("expert_read_gbps") or s.get("dense_read_gbps"):
        lines.append(f"kernel rates (timed on the engine): expert kernel "
                     f"{_f(s.get('expert_read_gbps'), '.4g')} GB/s at "
                     f"{_f(s.get('expert_read_experts'))} experts a layer, the step without "
                     f"experts {_f(s.get('dense_read_gbps'), '.4g')} GB/s")
    if p is not None:
        err = prediction_error(s)
        lines.append(f"cost model (profile {p['profile']}): {p['tok_s']:.4g} decode tok/s, "
                     f"binding {p['binding']}; measured over the same steps "
                     f"{_f(s.get(p['compare_with']))} ({_f(err and 100 * err, '+.1f')} %)")
    return lines


def render_summary(s: dict[str, Any]) -> str:
    """The summary row as the lines `strata bench` prints."""
    lines = [*_run_lines(s), *_bound_lines(s), *_model_lines(s)]
    if not s["tokens_equal_across_repeats"]:
        lines.append("warning: the repeats gave different tokens")
    return "\n".join(lines)


def write_rows(rows: list[dict[str, Any]], where: str | os.PathLike) -> None:
    """JSON lines, one per row ('-': stdout)."""
    text = "".join(json.dumps(r, default=_jsonable) + "\n" for r in rows)
    if str(where) == "-":
        sys.stdout.write(text)
    else:
        Path(where).write_text(text)


def _jsonable(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


# --- names the scripts under benchmarks/ still read from here (they moved to `ceilings`,
# `fingerprint` and `kernel_rates`; the public ones are imported above as themselves) ----------

_best = best_seconds
_device_read_gbps = device_read_gbps
_matmul_tflops = matmul_tflops
