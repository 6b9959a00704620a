"""The host expert kernel (`strata_jax.ops.host_experts.swiglu`) against a plain read of the same
bytes, on the same machine in the same run (issue 19).

Tier-1 experts of the chosen shape (random bf16, generated on the device and copied into
`pinned_host` memory, as the engine's tier 1 is) are read in place through the kernel's own
views. The plain read is a numpy sum of each expert's bytes as uint64 words, in one chunk per thread
on as many threads as the kernel uses: the rate any kernel that reads the weights once can
reach. Candidates: the compiled C kernel (`host_kernel`, the engine's kernel), torch's own
threads on one call per product (the kernel before it), and column blocks with one
single-threaded torch call per core; the torch ones need torch. Each timed call takes the
next expert (round robin over more bytes than the caches hold). Per row count and thread
count: GB/s of expert bytes, and the ratio to the plain read.

Run: `python -m benchmarks.host_kernels --out DIR [--shape mixtral-8x7b] [--experts 8]
[--candidates c,torch] [--threads 15,16]`; writes DIR/host_kernels.jsonl and DIR/host_kernels.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

from benchmarks.common import machine
from strata_jax.ops import host_experts, host_kernel
from strata_jax.ops.pool import ExpertPool

SHAPES = {"mixtral-8x7b": (4096, 14336), "tiny": (128, 256)}


def pinned_pool(d: int, f: int, experts: int, seed: int = 0, fmt: str = "bf16") -> ExpertPool:
    """`experts` random experts in pinned host memory: bf16 [experts, in, out], or packed int4
    with bf16 group scales as the offloaded int4 rows of step_decode hold them (row-major)."""
    dev = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    if fmt == "int4":
        from types import SimpleNamespace

        from benchmarks.step_decode import random_experts

        shape = SimpleNamespace(hidden_size=d, expert_intermediate_size=f, num_layers=1,
                                num_experts=experts)  # all random_experts reads of a config
        pool = random_experts(shape, "int4", jax.random.key(seed), None)
        return jax.tree.map(lambda a: jax.block_until_ready(jax.device_put(a, pinned)), pool)
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = {"w1": (experts, d, f), "w3": (experts, d, f), "w2": (experts, f, d)}
    arrays = {}
    for key, (name, shape) in zip(keys, shapes.items(), strict=True):
        a = (jax.random.normal(key, shape, "float32") * 0.02).astype("bfloat16")
        arrays[name] = jax.block_until_ready(jax.device_put(a, pinned))
        del a
    return ExpertPool(**arrays)


def timed(fn, calls: int) -> float:
    """Median seconds of `calls` calls of fn(i) after one untimed call."""
    fn(calls)
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def plain_read(views, slots: int, calls: int, threads: int) -> float:
    """Median seconds to read one expert's bytes once (every array of it, scales too): numpy
    sums of uint64 words over `threads` contiguous chunks of each array on as many threads (a
    vectorized reduction that releases the GIL; no conversion, no writes)."""
    pool = ThreadPoolExecutor(threads)
    flat = {k: [views[k][s].reshape(-1).view(np.uint64) for s in range(slots)] for k in views}

    def read(i):
        chunks = [c for k in views for c in np.array_split(flat[k][i % slots], threads)]
        list(pool.map(np.add.reduce, chunks))

    try:
        return timed(read, calls)
    finally:
        pool.shutdown()


def torch_views(views):
    """torch tensors over the numpy views (no copy)."""
    import torch

    out = {}
    for k in host_experts.KINDS:
        v = views[k]
        bf16 = v.dtype == host_kernel.BF16
        t = torch.from_numpy(v.view(np.uint16) if bf16 else v)
        out[k] = t.view(torch.bfloat16) if bf16 else t
    return out


def torch_swiglu(views, slot: int, x):
    """The torch kernel host_experts used before the C kernel: one call per product."""
    import torch

    w1, w3, w2 = (views[k][slot] for k in host_experts.KINDS)
    act = (torch.nn.functional.silu((x @ w1).float()) * (x @ w3).float()).to(x.dtype)
    return (act @ w2).float()


def column_blocks(views, slot: int, x, pool: ThreadPoolExecutor, threads: int):
    """A candidate kernel: each product's output columns cut into one block per core, each
    block a single-threaded torch matmul (torch at 1 thread) on a thread of `pool`."""
    import torch

    def products(pairs):
        outs = [torch.empty((a.shape[0], w.shape[1]), dtype=a.dtype) for a, w in pairs]
        jobs = []
        for (a, w), out in zip(pairs, outs, strict=True):
            n = w.shape[1]
            width = -(-n // threads // 64) * 64
            jobs += [(a, w, out, c, min(c + width, n)) for c in range(0, n, width)]

        def one(job):
            a, w, out, lo, hi = job
            out[:, lo:hi] = a @ w[:, lo:hi]

        list(pool.map(one, jobs))
        return outs

    gate, up = products([(x, views["w1"][slot]), (x, views["w3"][slot])])
    act = (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)
    return products([(act, views["w2"][slot])])[0].float()


def kernel(views, slots: int, rows: int, calls: int, threads: int, candidate: str) -> float:
    d = host_experts.hidden_size(views)
    x = np.random.default_rng(rows).normal(0, 1, (rows, d)).astype(host_kernel.BF16)
    if candidate in ("c", "c-vdp") or candidate.startswith("c+"):
        host_experts.set_threads(threads)
        host_kernel.set_build({"c": None, "c-vdp": VDP_MARCH}.get(
            candidate, host_kernel.MARCH + candidate[1:]))
        try:
            return timed(lambda i: host_experts.swiglu(views, i % slots, x), calls)
        finally:
            host_kernel.set_build(None)
    import torch

    tv = torch_views(views)
    xt = torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    if candidate == "torch":
        torch.set_num_threads(threads)
        return timed(lambda i: torch_swiglu(tv, i % slots, xt), calls)
    torch.set_num_threads(1)
    with ThreadPoolExecutor(threads) as pool:
        return timed(lambda i: column_blocks(tv, i % slots, xt, pool, threads), calls)


VDP_MARCH = "cooperlake"  # AVX512-BF16 without AMX tiles: the kernel's vdpbf16ps path alone
CANDIDATES = {"c": "the compiled C kernel (host_kernel, host_experts.swiglu)",
              "c-vdp": f"the C kernel built for {VDP_MARCH} (vdpbf16ps, no AMX tiles)",
              "torch": "one torch call per product on torch's threads",
              "blocks": "column blocks, one single-threaded torch call per core"}


def startup_rates(views_tier: int, times: int) -> list[dict]:
    """`host_experts.measure_with_copies` (the engine's start-up timing of the kernel and the
    link at work at once, which the "auto" split decides by) called `times` times in a row:
    how much one start-up's rates can vary."""
    out = []
    for i in range(times):
        link, gbps, growth = host_experts.measure_with_copies(views_tier, jax.devices()[0])
        out.append({"trial": i, "link_gbps": link, "host_gbps": gbps, "row_cost": growth,
                    "threads": host_kernel.threads(), "machine": machine()})
        print(f"  start-up rates, trial {i}: kernel {gbps:.1f} GB/s at 1 row "
              f"(+{growth:.3f}/row), link {link:.1f} GB/s at once", flush=True)
    return out


def run(args: argparse.Namespace) -> list[dict]:
    d, f = SHAPES[args.shape]
    pool = pinned_pool(d, f, args.experts, fmt=args.format)
    tier = host_experts.register(pool)
    views = host_experts.tier(tier).views
    nbytes = sum(v[0].nbytes for v in views.values())
    cores = os.cpu_count() or 1
    rows_out = []
    if args.startup_rates:
        host_experts.set_threads(None)
        with open(Path(args.out) / "host_rates.jsonl", "a") as fh:
            for r in startup_rates(tier, args.startup_rates):
                fh.write(json.dumps(r) + "\n")
    for threads in args.threads or sorted({cores, max(1, cores - 1)}):
        read_s = plain_read(views, args.experts, args.calls, threads)
        read_gbps = nbytes / read_s / 1e9
        base = {"shape": args.shape, "format": args.format, "threads": threads,
                "expert_bytes": nbytes,
                "plain_read_gbps": read_gbps, "isa": host_kernel.isa(), "machine": machine()}
        print(f"threads {threads}: plain read {read_gbps:.1f} GB/s", flush=True)
        for candidate in args.candidates:
            name = CANDIDATES.get(candidate) or f"the C kernel built with {candidate[2:]}"
            for rows in args.rows:
                s = kernel(views, args.experts, rows, args.calls, threads, candidate)
                gbps = nbytes / s / 1e9
                row = {**base, "kernel": name, "rows": rows, "ms": s * 1e3, "gbps": gbps,
                       "ratio": gbps / read_gbps}
                print(f"  {candidate:6s} rows {rows:3d}: {s * 1e3:7.2f} ms {gbps:6.1f} GB/s = "
                      f"{gbps / read_gbps:.2f} of the plain read", flush=True)
                rows_out.append(row)
    host_experts.release(tier)
    return rows_out


def render(rows: list[dict]) -> str:
    env = rows[0]["machine"]
    lines = [f"# Host expert kernel vs a plain read, {rows[0]['shape']} bf16 experts "
             f"({env['device']} host, JAX {env['jax']}, {env['date']}; C kernel built for "
             f"{rows[0].get('isa', '?')})", "",
             "Tier-1 experts in pinned host memory read in place; plain read = numpy uint64 "
             "sums of the same expert's bytes, one chunk per thread, on as many threads; one "
             "expert per call, round robin over more bytes than the caches hold; median of "
             "the calls.", "",
             "| threads | rows | kernel | ms / expert | GB/s | plain read GB/s | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['rows']} | {r['kernel']} | {r['ms']:.2f} | "
                     f"{r['gbps']:.1f} | {r['plain_read_gbps']:.1f} | {r['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-8x7b")
    ap.add_argument("--experts", type=int, default=8, help="experts read round robin")
    ap.add_argument("--format", choices=("bf16", "int4"), default="bf16",
                    help="the experts' format in tier 1 (int4: packed, bf16 group scales; the "
                         "C kernel only)")
    ap.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")],
                    default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--calls", type=int, default=8, help="timed calls per figure")
    ap.add_argument("--candidates", type=lambda s: s.split(","), default=["c", "torch"],
                    help=f"kernels timed, of {','.join(CANDIDATES)}, or c+NAME=VALUE[+...]: the "
                         "C kernel built with tuning constants of host_kernel.c (AMX_KB ...)")
    ap.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=None,
                    help="thread counts (default: all cores, and all but one)")
    ap.add_argument("--startup-rates", type=int, default=0, metavar="N",
                    help="first call host_experts.measure_with_copies N times on the default "
                         "threads (OUT/host_rates.jsonl): the spread of the engine's start-up "
                         "rates")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run(args)
    with open(out / "host_kernels.jsonl", "a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    (out / "host_kernels.md").write_text(render(rows))
    print(f"wrote {out / 'host_kernels.md'}")


if __name__ == "__main__":
    main()
