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
bytes and FLOPs the run's counters give:
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
The bound divides each by its ceiling, measured once at the start of a run
(`measure_ceilings`): time >= max(t_hbm, t_compute) + max(t_link, t_host) + t_disk, since the
engine's copies and disk loads serialize with the step that waits for them (the host's share of
the misses beside the copies) while HBM reads and matmuls overlap; bound tok/s = generated
tokens / that time, `ratio` = measured / bound (1.0: at the ceiling), `binds` = the largest
term. `roofline_tok_s` is the looser bound with every term overlapped (max of all).

The cost model (`cost_model.predict`) predicts decode tok/s from the decode steps' counters
(the engine counts decode steps and prefill chunks apart) as means per decode step
(`prediction`), on the ceilings measured in the run (profile "measured") or a shipped profile;
compare it with the engine's decode tok/s, which leaves prefill out too. With the measured
profile the routed experts' bytes count at the rate the engine's own expert kernel reads them
(`expert_kernel_gbps`, timed on the engine's pool after its warm-up, as many experts as a layer
of it routed: a quantized kernel dequantizes as it reads, below the plain read), and the dense
bytes at the rate of the model's own decode step without its experts (`dense_kernel_gbps`: a
matmul of a few rows reads below a plain read, and the step's small kernels leave gaps); the
bound keeps the plain read. Its link is
the one the decode steps use (`step_link`: as many experts as a layer copied in the warm-up,
by the step's own copy out of the engine's tier 1), which the bound uses too where it is faster
than the ceiling's.

The median's 95 % interval is a percentile bootstrap of the median over the repeats (10,000
resamples drawn from the bench seed): it cannot be wider than the repeats' range, so it is
narrow for few repeats (use 5 or more).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.formats.config import ModelConfig
from strata_jax.model.decoder import cached_attention, copy_in, lm_head, route_layer, with_shared
from strata_jax.ops.expert_kernels import grouped_swiglu
from strata_jax.ops.pool import ExpertPool
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine, link_rate
from strata_runtime.engine.stats import DeviceCounts, PhaseCounts
from strata_runtime.lab.cost_model import (
    HardwareProfile,
    ModelCost,
    link_name,
    model_cost,
    predict,
    profile,
)

REPO = Path(__file__).resolve().parents[2]
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


# --- the machine ----------------------------------------------------------------------------


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20,
                             check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> int | None:
    """NUMA nodes the kernel lists (None: no /sys/devices/system/node)."""
    if not root.is_dir():
        return None
    return sum(1 for p in root.glob("node[0-9]*") if p.is_dir())


def nvidia_smi() -> list[dict[str, str]] | None:
    """Per GPU: name, driver, PCIe generation (current, max) and width; None: no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    fields = ("name", "driver_version", "pcie.link.gen.current", "pcie.link.gen.max",
              "pcie.link.width.current", "memory.total")
    text = _run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"])
    if text is None:
        return None
    return [dict(zip(fields, (c.strip() for c in line.split(",")), strict=False))
            for line in text.splitlines() if line.strip()]


def git_commit(repo: Path = REPO) -> dict[str, object] | None:
    """The checkout's HEAD and whether tracked files differ from it; None: not a git checkout."""
    head = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    if head is None:
        return None
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    return {"commit": head, "dirty": bool(status) if status is not None else None}


def hardware_fingerprint(link_gbps: float | None = None) -> dict[str, object]:
    """Where a number was measured: device, jax / jaxlib, host cores and NUMA nodes, the
    pinned host -> device rate (GPU only; `link_gbps` if already measured, else
    `engine.link_rate`), nvidia-smi's PCIe generation, the git commit, python."""
    import jaxlib

    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    if gpu and link_gbps is None:
        link_gbps = max(link_rate(dev) for _ in range(3))
    smi = nvidia_smi() if gpu else None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    return {
        "gpu": dev.device_kind if gpu else "cpu",
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "host_cores": os.cpu_count(),
        "usable_cores": usable,
        "numa_nodes": numa_nodes(),
        "pinned_h2d_gbps": link_gbps if gpu else None,
        "pcie_gen": smi[0].get("pcie.link.gen.current") if smi else None,
        "pcie_gen_max": smi[0].get("pcie.link.gen.max") if smi else None,
        "pcie_width": smi[0].get("pcie.link.width.current") if smi else None,
        "nvidia_smi": smi,
        "git": git_commit(),
        "python": platform.python_version(),
        "os": platform.platform(),
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


GPU_WARM_S = 1.0  # seconds of untimed work before a device ceiling is timed (`_best`)
CHAIN = 8  # kernel calls chained in one program when a device rate is timed (`_chained`)


def _best(fn: Callable[[], object], reps: int, warm_s: float = 0.0) -> float:
    """Best wall time of `reps` calls of `fn`, after one untimed call and, with `warm_s`, after
    calling it for that long, so that a short timed window does not catch a device still in a
    slower state after idling (`benchmarks/ceiling_warmup_probe.py` times both ways)."""
    fn()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _chained(kernel: Callable, x, args: tuple, chain: int, reps: int,
             warm_s: float = 0.0) -> float:
    """Seconds per call of `kernel(x, *args)` (-> the next x, the same shape), timed as `chain`
    calls chained in one jitted program, each on the last one's output (so none is merged with
    another or hoisted): a device rate from one dispatch, not from a wall time in which one
    launch and one wait for the host weigh as much as a short kernel (docs/design.md,
    "Benchmarks and sweeps"). `args` are the program's arguments, never its constants."""
    def run(x, args):
        for _ in range(chain):
            x = kernel(x, *args)
        return x

    run = jax.jit(run)
    return _best(lambda: jax.block_until_ready(run(x, args)), reps, warm_s) / chain


def host_read_gbps(nbytes: int, threads: int | None = None) -> float:
    """Host DRAM read GB/s: numpy sums of `threads` slices of one array at once (numpy lets
    go of the GIL in the reduction), best of 3."""
    threads = threads or os.cpu_count() or 1
    x = np.ones(nbytes // 8, np.float64)
    parts = np.array_split(x, threads)
    with ThreadPoolExecutor(threads) as pool:
        seconds = _best(lambda: list(pool.map(np.sum, parts)), 3)
    return x.nbytes / seconds / 1e9


def _device_read_gbps(dev: jax.Device, nbytes: int, reps: int, warm_s: float,
                      chain: int) -> float:
    x = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), dev)
    acc = jax.device_put(jnp.zeros((), jnp.float32), dev)
    # each sum adds the last one's (scaled) result to every element: a full read per call
    seconds = _chained(lambda a, x: jnp.sum(x + a) * 1e-9, acc, (x,), chain, reps, warm_s)
    return x.nbytes / seconds / 1e9


def _matmul_tflops(dev: jax.Device, n: int, dtype, reps: int, warm_s: float,
                   chain: int) -> float:
    a = jax.device_put(jnp.full((n, n), 1.0 / n, dtype), dev)  # powers of two: stays 1 / n
    return 2 * n**3 / _chained(lambda c, a: c @ a, a, (a,), chain, reps, warm_s) / 1e12


def expert_kernel_gbps(pool: ExpertPool, hidden: int, dtype, rows: int, experts: int,
                      int4_tiles=None, reps: int = 20, chain: int = CHAIN) -> float:
    """GB/s of expert bytes the engine's expert kernel (`expert_kernels.grouped_swiglu`, the
    path it picks for `rows` rows and the pool's format) reads applying `experts` slots of
    `pool` to `rows` rows (a layer's worth of experts, as a decode step reads them): `chain`
    layers' worth in one program, each on the last one's output, best wall time of `reps`."""
    experts = max(1, min(experts, pool.num_slots))
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((rows, hidden)),
                                   dtype), pool.w1.sharding)
    slots = jax.device_put(jnp.arange(experts, dtype=jnp.int32), pool.w1.sharding)

    def layer(x, slots, pool):  # tanh keeps the chained rows bounded
        return jnp.tanh(grouped_swiglu(x, slots, pool, None, int4_tiles).sum((0, 1))
                        ).astype(x.dtype)

    per_slot = sum(a.nbytes for a in pool if a is not None) / pool.num_slots
    return experts * per_slot / _chained(layer, x, (slots, pool), chain, reps) / 1e9


def dense_kernel_gbps(cfg: ModelConfig, params: dict[str, Any], rows: int, cache_len: int,
                      unroll: bool, reps: int = 20) -> float:
    """GB/s of dense bytes (the params but the embedding table, as `engine_sizes` counts them)
    that the model's decode step reads without its experts, at `rows` rows of one token: every
    layer's attention over a cache of `cache_len` positions (`model.cached_attention`, the
    cache updated in place as the step's is), its routing and its shared expert, the layers
    scanned as the step scans them (`unroll`: the step plan's; a rolled scan copies each
    layer's weights out of the stacks first), then the lm head, in one program; best wall
    time of `reps`. The step's dense matmuls, its attention and its routing, many small
    kernels among them, run at this rate, not at a plain read's (docs/design.md, "The cost
    model"). The rows are the embeddings of `rows` seeded token ids at position 0. It holds a
    cache of the engine's size beside the engine's own while it runs (outside the ledger, freed
    on return): where the device lacks the room, `_kernel_rates` falls back to the device
    read."""
    p = params["params"]
    dev = next(iter(p["final_norm"].devices()))
    ids = np.random.default_rng(0).integers(cfg.vocab_size, size=rows)
    x = jax.device_put(p["embed"][ids][:, None], dev)
    positions = jax.device_put(jnp.zeros((rows, 1), jnp.int32), dev)
    shape = (cfg.num_layers, rows, cache_len, cfg.num_kv_heads, cfg.head_dim)
    cache = [jnp.zeros(shape, cfg.dtype, device=dev) for _ in range(2)]

    def layer(carry, xs):
        x, k_all, v_all = carry
        lp, li = xs
        x, k_all, v_all = cached_attention(cfg, lp, x, positions, k_all, v_all, li, None)
        h, routing = route_layer(cfg, lp, x)
        x = x + with_shared(cfg, lp, h, jnp.zeros_like(h)).reshape(x.shape)
        return (x, k_all, v_all), routing.experts

    def step(x, k_all, v_all, p):
        (x, k_all, v_all), experts = jax.lax.scan(
            layer, (x, k_all, v_all), (p["layers"], jnp.arange(cfg.num_layers)), unroll=unroll)
        return lm_head(cfg, p, x), experts, k_all, v_all

    run = jax.jit(step, donate_argnums=(1, 2))

    def call():
        logits, experts, *cache[:] = run(x, *cache, p)
        return logits, experts

    return dense_bytes(cfg, params) / _best(lambda: jax.block_until_ready(call()), reps) / 1e9


def step_link(engine: Engine, layers: int, reps: int = 3) -> dict[str, Any] | None:
    """The link as the engine's decode steps use it (None when they copied nothing): GB/s of as
    many of its experts as a decode step's layer copied in the engine's counters so far (the
    warm-up's), copied out of its tier-1 pool by the step's own copy (`copy_in_gbps`), best of
    `reps`. Copies made apart (`engine.link_rate`) may run faster than the step's, and a
    layer's few copies below the rate of many (docs/design.md, "Benchmarks and sweeps")."""
    d = engine.counters.decode
    copies = d.fetched + d.prefetched
    host = None if engine.resident else engine.shares[0].residency.host
    if host is None or not d.calls or not copies:
        return None
    per_link = copies / d.calls / layers / len(engine.devices)  # the devices copy side by side
    count = int(np.clip(round(per_link), 1, host.w1.shape[0]))
    gbps = copy_in_gbps(host, count, reps)
    return {"gbps": gbps, "copy_bytes": _slot_bytes(host), "copies": count}


def copy_in_gbps(host: ExpertPool, count: int, reps: int = 3) -> float:
    """GB/s of `count` experts of the pinned-host pool `host` copied into device memory the way
    a step copies a layer's misses (`model.copy_in`: a dynamic slice of the pinned-host arrays
    into `device_put`, one expert after another, in one program), from slots spread over the
    pool; the best of `reps` calls after a compiling one."""
    dev = next(iter(host.w1.devices()))
    slots = host.w1.shape[0]
    scratch = ExpertPool(*(None if a is None else
                           jnp.zeros((count, *a.shape[1:]), a.dtype, device=dev) for a in host))
    ids = jax.device_put(np.linspace(0, slots - 1, count).astype(np.int32), dev)
    run = jax.jit(lambda pool, pinned, src: copy_in(pool, pinned, src, 0, count),
                  donate_argnums=0)
    scratch = jax.block_until_ready(run(scratch, host, ids))
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        scratch = jax.block_until_ready(run(scratch, host, ids))
        best = min(best, time.perf_counter() - t0)
    return count * _slot_bytes(host) / max(best, 1e-9) / 1e9


def _slot_bytes(pool: ExpertPool) -> int:
    """Bytes of one slot of `pool` (every array's)."""
    return sum(a.nbytes // a.shape[0] for a in pool if a is not None)


def measure_ceilings(quick: bool | None = None) -> dict[str, Any]:
    """The rates the bound divides by, measured now on the default device: pinned host ->
    device (`engine.link_rate`, best of 3: eight copies in flight), host read (`host_read_gbps`),
    device-memory read (a jitted sum, best wall time), matmul (a jitted square matmul, bf16 on
    a GPU, float32 on a CPU); the device's two after `GPU_WARM_S` of untimed work each. `quick`
    (default: on a CPU backend) uses small arrays and no warm-up: the CPU figures only make the
    bound's arithmetic run, they are not a GPU's."""
    dev = jax.devices()[0]
    quick = dev.platform == "cpu" if quick is None else quick
    big, n, reps = (64 << 20, 512, 3) if quick else (1 << 30, 8192, 10)
    link = max(link_rate(dev, min(big, 64 << 20)) for _ in range(3))
    host = host_read_gbps(big)
    warm = 0.0 if quick else GPU_WARM_S
    chain = 2 if quick else CHAIN
    hbm = _device_read_gbps(dev, 2 * big, reps, warm, chain)
    dtype = jnp.float32 if dev.platform == "cpu" else jnp.bfloat16
    tflops = _matmul_tflops(dev, n, dtype, reps, warm, chain)
    try:
        stats = dev.memory_stats() or {}
    except (AttributeError, NotImplementedError, RuntimeError):
        stats = {}
    return {"pinned_h2d_gbps": link, "host_read_gbps": host, "hbm_read_gbps": hbm,
            "matmul_tflops": tflops, "matmul_dtype": jnp.dtype(dtype).name,
            "hbm_gib": stats.get("bytes_limit", 0) / (1 << 30), "disk_read_gbps": {},
            "sizes": {"host_read_bytes": big, "device_read_bytes": 2 * big, "matmul_n": n,
                      "device_warm_s": warm, "device_chain": chain},
            "quick": quick}


def drop_page_cache(root: Path) -> None:
    """Ask the kernel to drop the cached pages of every file under `root`."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_read_gbps(reader: CheckpointReader, threads: int, experts: int = 8,
                   warm: bool = False) -> float:
    """GB/s of reading (and verifying) whole experts, `threads` at a time as the engine's
    fetch threads read them: cold (page cache dropped first) or `warm` (read once untimed, so
    the page cache holds them)."""
    cfg = reader.config
    keys = [(i // cfg.num_experts % cfg.num_layers, i % cfg.num_experts)
            for i in range(min(experts, cfg.num_layers * cfg.num_experts))]

    def one(key: tuple[int, int]) -> int:
        return sum(reader.read_expert(*key, n).nbytes for n in reader.expert_specs)

    with ThreadPoolExecutor(threads) as pool:
        if warm:
            list(pool.map(one, keys))
        else:
            drop_page_cache(Path(reader.path) / "experts")
        t0 = time.perf_counter()
        nbytes = sum(pool.map(one, keys))
    return nbytes / (time.perf_counter() - t0) / 1e9


def measured_profile(ceilings: dict[str, Any], fingerprint: dict[str, Any]) -> HardwareProfile:
    """The cost model's profile of this run's ceilings."""
    return HardwareProfile(
        name="measured", pcie_gbps=ceilings["pinned_h2d_gbps"],
        host_read_gbps=ceilings["host_read_gbps"], hbm_gbps=ceilings["hbm_read_gbps"],
        hbm_gib=ceilings["hbm_gib"], matmul_tflops=ceilings["matmul_tflops"],
        host_cores=int(fingerprint.get("host_cores") or 0),
        source="measured at the start of this run (strata_runtime.lab.bench.measure_ceilings)")


# --- counting -------------------------------------------------------------------------------


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
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    swaps: int = 0
    read_ahead: int = 0
    decode: PhaseCounts = dataclasses.field(default_factory=PhaseCounts)
    """The decode steps' counters, which the cost model's prediction reads."""
    prefill: PhaseCounts = dataclasses.field(default_factory=PhaseCounts)
    devices: tuple[DeviceCounts, ...] = ()
    """Each device's share (`EngineStats.devices`)."""

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

    def disk_bytes(self, c: PhaseCounts) -> int:
        return c.disk_loads * self.bytes_per_expert

    def hosted_bytes(self, c: PhaseCounts) -> int:
        """Expert bytes the host kernel read (misses computed on the host)."""
        return c.hosted * self.bytes_per_expert

    def flops(self, c: Counts) -> float:
        return self.flops_per_token * (c.decode_tokens + c.prefill_tokens)

    def model(self) -> ModelCost:
        return ModelCost(bytes_per_expert=self.bytes_per_expert, dense_bytes=self.dense_bytes,
                         flops_per_token=self.flops_per_token)


def dense_bytes(cfg: ModelConfig, params: dict[str, Any]) -> int:
    """Bytes a decode step reads of the dense params: all of them but the embedding table (a
    step reads a row of it), which it reads whole as the lm head where the two are tied."""
    embed = params["params"]["embed"]
    return (sum(a.nbytes for a in jax.tree.leaves(params))
            - (0 if cfg.tie_word_embeddings else embed.nbytes))


def engine_sizes(engine: Engine) -> Sizes:
    cfg = engine.cfg
    return Sizes(bytes_per_expert=int(engine.counters.bytes_per_expert),
                 dense_bytes=dense_bytes(cfg, engine.params),
                 kv_bytes=int(engine.state.k.nbytes + engine.state.v.nbytes),
                 rows=engine.capacity, flops_per_token=model_cost(cfg).flops_per_token)


def _counts(engine: Engine, wall_s: float, new_tokens: int) -> Counts:
    c = engine.counters
    return Counts(wall_s=wall_s, new_tokens=new_tokens, decode_steps=c.decode_steps,
                  decode_tokens=c.decode_tokens, decode_s=c.decode_s,
                  prefill_tokens=c.prefill_tokens, prefill_s=c.prefill_s, swaps=c.swaps,
                  read_ahead=c.read_ahead,
                  decode=dataclasses.replace(c.decode), prefill=dataclasses.replace(c.prefill),
                  devices=tuple(dataclasses.replace(d) for d in c.devices))


def bound(c: Counts, sizes: Sizes, ceilings: dict[str, Any], disk_gbps: float | None,
          link_gbps: float | None = None) -> dict[str, Any]:
    """The run's bound from its counted bytes and FLOPs and the measured ceilings (module
    docstring); a disk term only where disk loads happened and a disk rate was measured. Over
    several devices the links copy side by side: the link term is the busiest device's.
    `link_gbps`: the fastest pinned copy rate measured (default: the ceiling's)."""
    pcie = link_gbps or ceilings["pinned_h2d_gbps"]
    link = min(pcie, ceilings["host_read_gbps"]) * 1e9
    name = link_name(pcie, ceilings["host_read_gbps"])
    t = c.total
    h2d = max((d.h2d_bytes(sizes.bytes_per_expert) for d in c.devices),
              default=sizes.h2d_bytes(t))
    seconds = {"hbm": sizes.hbm_bytes(c) / (ceilings["hbm_read_gbps"] * 1e9),
               "compute": sizes.flops(c) / (ceilings["matmul_tflops"] * 1e12),
               name: h2d / link}
    disk = sizes.disk_bytes(t)
    if disk and disk_gbps:
        seconds["disk"] = disk / (disk_gbps * 1e9)
    beside = 0.0  # the host's misses run beside the link's copies
    if t.hosted:
        seconds["host-compute"] = sizes.hosted_bytes(t) / (ceilings["host_read_gbps"] * 1e9)
        beside = min(seconds["host-compute"], seconds[name])
    serial = max(seconds["hbm"], seconds["compute"]) + sum(
        t for k, t in seconds.items() if k not in ("hbm", "compute")) - beside
    roof = max(seconds.values())
    bound_tok_s = c.new_tokens / serial if serial > 0 else None
    return {"seconds": seconds, "bound_s": serial, "bound_tok_s": bound_tok_s,
            "roofline_tok_s": c.new_tokens / roof if roof > 0 else None,
            "ratio": serial / c.wall_s if c.wall_s > 0 and serial > 0 else None,
            "binds": max(seconds, key=seconds.get),
            "disk_unbounded": bool(disk and not disk_gbps)}


def prediction(c: Counts, sizes: Sizes, hw: HardwareProfile,
               layers: int) -> dict[str, Any] | None:
    """The cost model's decode tok/s from the run's decode steps (None: no decode step).
    Inputs, from the decode steps' counters alone (`Counts.decode`; prefill chunks route and
    stall on disk far more, and the decode tok/s it is compared with leaves them out): batch =
    live rows per timed decode step; routed, misses (demand copies + prefetched experts: every
    routed expert without a tier-0 slot), hosted, admissions, disk loads per decode step;
    hidden = the misses' share the prefetch served; rerun = the share of a step's `layers` run
    again after disk stalls; extra_hbm_bytes = the KV cache (none with a measured dense rate,
    `dense_kernel_gbps`, whose program reads the cache). Unless the profile has a disk
    rate, disk loads count at the rate the decode steps' own loads achieved (their bytes /
    their stall seconds; every call's, if the decode stalls took no measurable time): how much
    of the checkpoint the page cache holds and how many loads a stall overlaps decide it,
    which no ceiling measured apart knows; unused = the prefetches issued that no layer
    used (they hold the link)."""
    d = c.decode
    if not c.decode_steps or not d.calls:
        return None
    if d.disk_loads and hw.disk_gbps <= 0:
        loads = d if d.disk_stall_s > 0 else c.total
        if loads.disk_stall_s > 0:
            hw = dataclasses.replace(hw, disk_gbps=sizes.disk_bytes(loads)
                                     / loads.disk_stall_s / 1e9)
    disk = d.disk_loads if hw.disk_gbps > 0 else 0
    need = d.fetched + d.prefetched
    steps = d.calls
    inputs = {"batch": c.decode_tokens / c.decode_steps, "routed": d.routed / steps,
              "misses": need / steps, "hosted": d.hosted / steps,
              "admissions": d.admissions / steps, "disk_loads": disk / steps,
              "unused": max(d.issued - d.prefetched, 0) / steps,
              "rerun": d.resumed_layers / (layers * steps) if disk else 0.0,
              "hidden": d.prefetched / need if need else 0.0,
              # a measured dense rate has the attention's cache reads in it already
              "extra_hbm_bytes": 0.0 if hw.dense_read_gbps else float(sizes.kv_bytes)}
    p = predict(hw, sizes.model(), **inputs)
    return {"profile": hw.name, "tok_s": p.tok_s, "binding": p.binding, "step_ms": 1e3 * p.step_s,
            "terms_ms": {k: 1e3 * v for k, v in p.terms.items()},
            "inputs": {**inputs, "bytes_per_expert": sizes.bytes_per_expert,
                       "dense_bytes": sizes.dense_bytes,
                       "flops_per_token": sizes.flops_per_token,
                       "disk_gbps": hw.disk_gbps if disk else None,
                       "expert_read_gbps": hw.expert_read_gbps or None,
                       "dense_read_gbps": hw.dense_read_gbps or None,
                       "link_gbps": hw.link_gbps},
            "compare_with": "decode_tok_s"}


def _pooled(p: dict[str, Any] | None) -> dict[str, Any] | None:
    """A prediction from the repeats' summed counts, to be read against the decode tok/s of
    the same sums (every repeat's decode tokens / their decode seconds), not the median."""
    return None if p is None else {**p, "compare_with": "decode_tok_s_pooled"}


def prediction_error(s: dict[str, Any]) -> float | None:
    """predicted / measured - 1 for a row (a repeat's or a summary), by its `compare_with`."""
    p = s.get("predicted")
    measured = None if p is None else s.get(p["compare_with"])
    if isinstance(measured, dict):
        measured = measured.get("median")
    return None if not measured else p["tok_s"] / measured - 1


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


def _figures(c: Counts, sizes: Sizes, steps_s: list[float]) -> dict[str, Any]:
    """The per-run figures a row reports (step percentiles over `steps_s`)."""
    times = np.asarray(steps_s) if steps_s else None
    per = max(c.steps, 1)
    decode = max(c.decode.calls, 1)
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
        "per_step": {"hbm_GB": sizes.hbm_bytes(c) / per / 1e9,
                     "h2d_GB": sizes.h2d_bytes(t) / per / 1e9,
                     "disk_GB": sizes.disk_bytes(t) / per / 1e9,
                     "ms_engine": 1e3 * (c.decode_s + c.prefill_s) / per,
                     "ms_disk_stall": 1e3 * t.disk_stall_s / per,
                     "decode_disk_GB": sizes.disk_bytes(c.decode) / decode / 1e9,
                     "decode_ms_disk_stall": 1e3 * c.decode.disk_stall_s / decode},
        "flops": sizes.flops(c),
        "disk_loads": t.disk_loads,
        "disk_stall_s": t.disk_stall_s,
        "devices": device_figures(c, sizes),
        "counts": c.doc(),
    }


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


def _kernel_rates(engine: Engine,
                  hw: HardwareProfile) -> tuple[HardwareProfile, int, dict[str, str]]:
    """`hw` with the rates of the engine's own kernels at its decode rows, once its warm-up has
    run: the expert kernel on its pool (`expert_kernel_gbps`) applying as many experts as a
    layer of the warm-up's decode steps routed (a kernel's fixed costs weigh more on fewer
    experts), and the step without its experts (`dense_kernel_gbps`); a rate that cannot be
    measured stays the device read's, its error returned by name. Returns (hw, the expert count, the
    errors)."""
    cfg, config = engine.cfg, engine.config
    rows, d = config.batch_capacity, engine.counters.decode
    experts = (round(d.routed / d.calls / cfg.num_layers) if d.calls
               else min(cfg.num_experts, cfg.top_k * rows))
    measure = {
        "expert_read_gbps": lambda: expert_kernel_gbps(
            engine.shares[0].residency.pool, cfg.hidden_size, cfg.dtype, rows, experts,
            config.int4_tiles),
        "dense_read_gbps": lambda: dense_kernel_gbps(cfg, engine.params, rows,
                                                     engine.state.max_len, engine.plan.unroll)}
    errors: dict[str, str] = {}
    for name, rate in measure.items():
        try:
            hw = dataclasses.replace(hw, **{name: rate()})
        except Exception as e:  # noqa: BLE001  (the prediction falls back to the HBM rate)
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"warning: {name} not measured ({errors[name]}): the prediction reads at "
                  "the device read rate instead", file=sys.stderr)
    return hw, experts, errors


def run_bench(ckpt: str | os.PathLike, config: EngineConfig, settings: BenchSettings, *,
              ceilings: dict[str, Any] | None = None,
              fingerprint: dict[str, Any] | None = None, label: str | None = None,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> BenchResult:
    """Warm-up apart, `settings.repeats` timed runs of a fresh engine (module docstring).
    `ceilings` and `fingerprint` are measured unless given (a sweep measures them once);
    `on_row` sees each row as it is made."""
    check_fits(config, settings)
    reader = CheckpointReader(ckpt)
    cfg = reader.config
    layers = cfg.num_layers
    prompts = synthetic_prompts(cfg.vocab_size, settings.prompts, settings.prompt_len,
                                settings.seed)
    ceilings = measure_ceilings() if ceilings is None else ceilings
    if fingerprint is None:
        fingerprint = hardware_fingerprint(ceilings["pinned_h2d_gbps"])
    hw = (measured_profile(ceilings, fingerprint) if settings.hardware == "measured"
          else profile(settings.hardware))
    head = {"label": label, "checkpoint": str(reader.path), "seed": settings.seed}
    rows: list[dict[str, Any]] = []
    tokens: list[list[list[int]]] = []
    counts: list[Counts] = []
    steps_s: list[float] = []
    t0 = time.perf_counter()
    with Engine(reader, config) as engine:
        build_s = time.perf_counter() - t0
        sizes = engine_sizes(engine)
        prefill_chunk = engine.prefill_chunk
        if engine.host_misses is not None and hw.host_kernel_gbps <= 0:  # the engine's own
            hw = dataclasses.replace(hw, host_kernel_gbps=engine.host_misses.rates.host_gbps,
                                     host_row_cost=engine.host_misses.rates.row_cost)
        t0 = time.perf_counter()
        engine.generate(prompts, settings.warmup_new or settings.new)  # compiles them all
        warmup_s = time.perf_counter() - t0
        compile_s = engine.stats()["compile_s"]
        kernel_errors: dict[str, str] = {}
        kernel_experts = None
        if settings.hardware == "measured":  # the rates of this engine's own kernels
            hw, kernel_experts, kernel_errors = _kernel_rates(engine, hw)
        link = step_link(engine, layers) if settings.hardware == "measured" else None
        if link is not None:
            hw = dataclasses.replace(hw, pcie_gbps=link["gbps"])
        link_gbps = max(ceilings["pinned_h2d_gbps"] or 0.0, link["gbps"] if link else 0.0)
        engine.reset_stats()
        for r in range(settings.repeats):
            t0 = time.perf_counter()
            out = engine.generate(prompts, settings.new)
            wall = time.perf_counter() - t0
            stats = engine.stats()  # observes the last step's record first
            c = _counts(engine, wall, sum(len(t) for t in out))
            run_steps = list(engine.counters.recent_steps)
            engine.reset_stats()
            disk = _disk_rate(ceilings, reader, config) if c.total.disk_loads else None
            row = {"kind": "repeat", **head, "repeat": r, **_figures(c, sizes, run_steps),
                   "bound": bound(c, sizes, ceilings, disk, link_gbps),
                   "predicted": prediction(c, sizes, hw, layers),
                   "tokens_sha256": tokens_digest(out),
                   "stats": stats, "fingerprint": fingerprint}
            rows.append(row)
            tokens.append(out)
            counts.append(c)
            steps_s += run_steps
            if on_row is not None:
                on_row(row)
    total = sum(counts, Counts())
    disk = _disk_rate(ceilings, reader, config) if total.total.disk_loads else None
    figures = _figures(total, sizes, steps_s)
    per_repeat = {k: median_interval([r[k] for r in rows], settings.seed)
                  for k in ("tok_s", "decode_tok_s", "prefill_tok_s")
                  if all(r[k] is not None for r in rows)}
    b = bound(total, sizes, ceilings, disk, link_gbps)
    tok = per_repeat["tok_s"]["median"]
    b["ratio"] = tok / b["bound_tok_s"] if b["bound_tok_s"] else None  # of the median
    summary = {
        "kind": "summary", **head, "repeats": settings.repeats,
        "settings": dataclasses.asdict(settings), "config": config_doc(config),
        "tok_s": per_repeat["tok_s"], "decode_tok_s": per_repeat.get("decode_tok_s"),
        "prefill_tok_s": per_repeat.get("prefill_tok_s"),
        "prefill_h2d_MB_per_token": figures["prefill_h2d_MB_per_token"],
        "prefill_ms_per_prompt": 1e3 * total.prefill_s / settings.repeats / len(prompts),
        "prefill_chunk": prefill_chunk,
        **{k: figures[k] for k in ("step_ms_p50", "step_ms_p99", "tier0_hit_rate",
                                   "prefetch_hit_rate", "bytes", "per_step", "flops",
                                   "devices")},
        "disk_loads": float(np.median([c.total.disk_loads for c in counts])),
        "disk_stall_s": float(np.median([c.total.disk_stall_s for c in counts])),
        "decode_tok_s_pooled": (total.decode_tokens / total.decode_s
                                if total.decode_s > 0 else None),
        "routed_gbps": routed_gbps(total, sizes),
        "bound": b, "predicted": _pooled(prediction(total, sizes, hw, layers)),
        "expert_read_gbps": hw.expert_read_gbps or None, "expert_read_experts": kernel_experts,
        "dense_read_gbps": hw.dense_read_gbps or None, "step_link": link,
        **({"kernel_rate_errors": kernel_errors} if kernel_errors else {}),
        "ceilings": ceilings,
        "sizes": dataclasses.asdict(sizes), "build_s": build_s,
        "build_phases_s": engine.startup, "warmup_s": warmup_s,
        "compile_s": compile_s, "tokens_sha256": rows[0]["tokens_sha256"],
        "tokens_equal_across_repeats": all(t == tokens[0] for t in tokens),
        "numa": rows[0]["stats"].get("numa"), "fingerprint": fingerprint,
    }
    rows.append(summary)
    if on_row is not None:
        on_row(summary)
    return BenchResult(rows, tokens)


def routed_gbps(c: Counts, sizes: Sizes) -> float | None:
    """The decode steps' effective routed-expert bandwidth: the bytes of every distinct expert
    a step routed to (as the slots hold them), wherever it was served from, over the decode
    seconds: what the write-up's peers report against the link and host DRAM rates."""
    if c.decode_s <= 0:
        return None
    return c.decode.routed * sizes.bytes_per_expert / c.decode_s / 1e9


def _disk_rate(ceilings: dict[str, Any], reader: CheckpointReader,
               config: EngineConfig) -> float:
    """The checkpoint's expert read rate for the bound, measured once per checkpoint and kept
    in `ceilings["disk_read_gbps"]` (after the timed runs: the drop of the page cache does not
    touch them): the faster of cold and warm, since the page cache may hold any part of a
    checkpoint that fits the host's memory."""
    rates = ceilings.setdefault("disk_read_gbps", {})
    key = str(reader.path)
    if key not in rates:
        rates[key] = {"cold": disk_read_gbps(reader, config.fetch_threads),
                      "warm": disk_read_gbps(reader, config.fetch_threads, warm=True)}
    return max(rates[key].values())


# --- output ---------------------------------------------------------------------------------


def _over(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _f(value: object, fmt: str = ".4g") -> str:
    return "-" if value is None else format(value, fmt)


def interval_text(iv: dict[str, Any] | None, fmt: str = ".4g") -> str:
    if iv is None:
        return "-"
    return f"{iv['median']:{fmt}} [{iv['lo']:{fmt}}, {iv['hi']:{fmt}}]"


def render_summary(s: dict[str, Any]) -> str:
    """The summary row as the lines `strata bench` prints."""
    st, b, p, c = s["settings"], s["bound"], s["predicted"], s["ceilings"]
    fp = s["fingerprint"]
    per = s["per_step"]
    lines = [
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
        f"{_f(s['step_ms_p99'])}",
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
