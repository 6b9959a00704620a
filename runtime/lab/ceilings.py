"""The machine's ceilings, measured: the rates a bench's bound divides by (docs/design.md,
"Benchmarks and sweeps"; `strata_runtime.lab.cost_model.bound`).

`measure_ceilings` times, on the default device, the pinned host -> device copy rate, the host's
DRAM read rate, the device-memory read rate and the matmul rate; `disk_read_gbps` times a
checkpoint's expert reads, cold or warm. A device rate is timed as `CHAIN` kernel calls chained in
one program (`chained_seconds`), after `GPU_WARM_S` of untimed work (`best_seconds`). The rates of
the engine's own kernels, timed on a built engine, are `strata_runtime.lab.kernel_rates`'.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.formats.checkpoint import CheckpointReader
from strata_runtime.residency.link import link_rate

GPU_WARM_S = 1.0  # seconds of untimed work before a device ceiling is timed (`best_seconds`)
CHAIN = 8  # kernel calls chained in one program when a device rate is timed (`chained_seconds`)


def best_seconds(fn: Callable[[], object], reps: int, warm_s: float = 0.0) -> float:
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


def chained_seconds(kernel: Callable, x, args: tuple, chain: int, reps: int,
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
    return best_seconds(lambda: jax.block_until_ready(run(x, args)), reps, warm_s) / chain


def host_read_gbps(nbytes: int, threads: int | None = None) -> float:
    """Host DRAM read GB/s: numpy sums of `threads` slices of one array at once (numpy lets
    go of the GIL in the reduction), best of 3."""
    threads = threads or os.cpu_count() or 1
    x = np.ones(nbytes // 8, np.float64)
    parts = np.array_split(x, threads)
    with ThreadPoolExecutor(threads) as pool:
        seconds = best_seconds(lambda: list(pool.map(np.sum, parts)), 3)
    return x.nbytes / seconds / 1e9


def device_read_gbps(dev: jax.Device, nbytes: int, reps: int, warm_s: float,
                     chain: int) -> float:
    """Device-memory read GB/s: a jitted sum of `nbytes`, `chain` of them chained."""
    x = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), dev)
    acc = jax.device_put(jnp.zeros((), jnp.float32), dev)
    # each sum adds the last one's (scaled) result to every element: a full read per call
    seconds = chained_seconds(lambda a, x: jnp.sum(x + a) * 1e-9, acc, (x,), chain, reps,
                              warm_s)
    return x.nbytes / seconds / 1e9


def matmul_tflops(dev: jax.Device, n: int, dtype, reps: int, warm_s: float,
                  chain: int) -> float:
    """Matmul TFLOP/s: square `n` x `n` matmuls in `dtype`, `chain` of them chained."""
    a = jax.device_put(jnp.full((n, n), 1.0 / n, dtype), dev)  # powers of two: stays 1 / n
    return 2 * n**3 / chained_seconds(lambda c, a: c @ a, a, (a,), chain, reps, warm_s) / 1e12


def _memory_stats(dev: jax.Device) -> dict[str, Any]:
    try:
        return dev.memory_stats() or {}
    except (AttributeError, NotImplementedError, RuntimeError):
        return {}


def measure_ceilings(quick: bool | None = None) -> dict[str, Any]:
    """The rates the bound divides by, measured now on the default device: pinned host ->
    device (`residency.link.link_rate`, best of 3: eight copies in flight), host read
    (`host_read_gbps`), device-memory read (a jitted sum, best wall time), matmul (a jitted
    square matmul, bf16 on a GPU, float32 on a CPU); the device's two after `GPU_WARM_S` of
    untimed work each. `quick` (default: on a CPU backend) uses small arrays and no warm-up:
    the CPU figures only make the bound's arithmetic run, they are not a GPU's."""
    dev = jax.devices()[0]
    quick = dev.platform == "cpu" if quick is None else quick
    big, n, reps = (64 << 20, 512, 3) if quick else (1 << 30, 8192, 10)
    link = max(link_rate(dev, min(big, 64 << 20)) for _ in range(3))
    host = host_read_gbps(big)
    warm = 0.0 if quick else GPU_WARM_S
    chain = 2 if quick else CHAIN
    hbm = device_read_gbps(dev, 2 * big, reps, warm, chain)
    dtype = jnp.float32 if dev.platform == "cpu" else jnp.bfloat16
    tflops = matmul_tflops(dev, n, dtype, reps, warm, chain)
    stats = _memory_stats(dev)
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


def checkpoint_disk_gbps(ceilings: dict[str, Any], reader: CheckpointReader,
                         threads: int) -> float:
    """The checkpoint's expert read rate for the bound, measured once per checkpoint and kept
    in `ceilings["disk_read_gbps"]` (measure it after the timed runs: the drop of the page
    cache does not touch them): the faster of cold and warm, since the page cache may hold any
    part of a checkpoint that fits the host's memory. `threads`: the engine's fetch
    threads."""
    rates = ceilings.setdefault("disk_read_gbps", {})
    key = str(reader.path)
    if key not in rates:
        rates[key] = {"cold": disk_read_gbps(reader, threads),
                      "warm": disk_read_gbps(reader, threads, warm=True)}
    return max(rates[key].values())
