"""Shared measurement helpers for the benchmark scripts."""

from __future__ import annotations

import datetime
import glob
import gzip
import json
import os
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


def wall_times(fn, reps: int = 10, warmup: int = 1) -> np.ndarray:
    """Wall times of `reps` calls of `fn()` (which must block until its device work is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return np.array(times)


def median_time(fn, reps: int = 10, warmup: int = 1) -> float:
    return float(np.median(wall_times(fn, reps, warmup)))


def _traced_events(fn, reps: int) -> tuple[list[dict], set]:
    """The complete events of `reps` calls of `fn()` (after one untimed call) from a profiler
    trace, and the ids of the GPU processes among them."""
    fn()
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(reps):
            fn()
    path = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)[0]
    trace = json.load(gzip.open(path))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in e.get("args", {}).get("name", "").upper()}
    return [e for e in events if e.get("ph") == "X"], gpu


def _ranked(events: list[dict], width: int, reps: int) -> dict[str, dict[str, float]]:
    """Events summed by name (cut to `width`): name -> count and microseconds per rep, the
    longest first."""
    totals: dict[str, list[float]] = {}
    for e in events:
        entry = totals.setdefault(e["name"][:width], [0, 0.0])
        entry[0] += 1
        entry[1] += float(e.get("dur", 0))
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])
    return {name: {"count": c / reps, "us": t / reps} for name, (c, t) in ranked}


def host_event_times(fn, top: int = 20) -> dict[str, dict[str, float]]:
    """The host-side events of one call of `fn()` from a profiler trace (XLA's and PjRt's
    annotations: program launches, transfers, waits; not the GPU's kernels): name -> count and
    total microseconds, longest first. Where the host blocks shows as a long event."""
    events, gpu = _traced_events(fn, 1)
    return dict(list(_ranked([e for e in events if e.get("pid") not in gpu], 80, 1).items())[:top])


def device_kernel_times(fn, reps: int = 5) -> dict[str, dict[str, float]]:
    """GPU kernels that `fn()` runs, from a profiler trace: name -> launches and device
    microseconds per call of `fn`, slowest first (the device time without dispatch gaps)."""
    events, gpu = _traced_events(fn, reps)
    return _ranked([e for e in events if e.get("pid") in gpu], 60, reps)


def device_gaps(fn, threshold_us: float = 20.0, top: int = 12) -> dict:
    """Where the GPU waits during one call of `fn()` (a profiler trace): its kernels and copies
    merged into busy intervals; `span_ms` first start to last end, `busy_ms`, `idle_ms` and
    `gaps` (idle stretches over `threshold_us`), and the `largest` of them with the events on
    either side (a gap before a program's first kernel is the host launching it late)."""
    events, gpu = _traced_events(fn, 1)
    device = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"][:60])
                    for e in events if e.get("pid") in gpu and e.get("dur"))
    if not device:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": 0, "largest": []}
    busy, gaps, end, last = 0.0, [], device[0][0], device[0][2]
    for start, stop, name in device:
        if start - end > threshold_us:
            gaps.append({"us": start - end, "after": last, "before": name})
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, last = stop, name
    return {"span_ms": (end - device[0][0]) / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": sum(g["us"] for g in gaps) / 1e3, "gaps": len(gaps),
            "largest": sorted(gaps, key=lambda g: -g["us"])[:top]}


def hbm_bandwidth() -> dict[str, float]:
    """Copy (read + write) and read-only (reduction) bandwidth over a 4 GiB array, GB/s: each
    the higher of the best wall time of 20 calls and the mean device kernel time of 10 (no
    dispatch), after a warm-up, so that neither a slow moment of the GPU nor launch overhead
    lowers the bound that kernels are compared with."""
    x = jax.random.normal(jax.random.PRNGKey(0), (1 << 30,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001 + 1.0)
    read = jax.jit(lambda a: jnp.sum(a))
    result = {}
    for name, fn, nbytes in (("copy", copy, 2 * x.nbytes), ("read", read, x.nbytes)):
        call = lambda fn=fn: fn(x).block_until_ready()  # noqa: E731
        wall = wall_times(call, reps=20, warmup=5).min()
        device = sum(k["us"] for k in device_kernel_times(call, reps=10).values()) * 1e-6
        result[name] = nbytes / min(wall, device) / 1e9
        result[f"{name}_wall"] = nbytes / wall / 1e9
    return result


def read_floor_us(nbytes: int, copies: int = 16) -> float:
    """Device microseconds of one XLA read (a sum, its kernels) of `nbytes`, over `copies`
    distinct buffers read in turn (none left in L2 by the one before): what a kernel that reads
    that many bytes gets from HBM, ramp-up and tail included."""
    bufs = [jnp.full((nbytes // 4,), i + 1, jnp.uint32) for i in range(copies)]
    read = jax.jit(lambda bs: [jnp.sum(b) for b in bs])
    kernels = device_kernel_times(lambda: jax.block_until_ready(read(bufs)), reps=5)
    return sum(k["us"] for k in kernels.values()) / copies


def machine() -> dict[str, str]:
    return {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
        "host": platform.node(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def pinned_bandwidth(array_bytes: list[int], experts: int = 8) -> float:
    """Host->device GB/s from `pinned_host` memory, moving `experts` experts whose arrays have
    the given sizes, back to back (the engine's transfer pattern)."""
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    target = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    rng = np.random.default_rng(0)
    arrays = [jax.device_put(rng.integers(0, 255, n, np.uint8), host)
              for _ in range(experts) for n in array_bytes]
    t = median_time(lambda: jax.block_until_ready(jax.device_put(arrays, target)), reps=5)
    return experts * sum(array_bytes) / t / 1e9
