"""Is tier 1's memory what holds the host side back? (issue 19)

The same expert bytes read three ways on one machine in one run: in place in tier 1
(`pinned_host` buffers, as the engine holds them), copied into plain numpy memory, and copied
into anonymous memory advised for transparent huge pages; each by the plain read of
`host_kernels.py` (numpy uint64 sums, one chunk per thread) and by the engine's C kernel at one
row, on several thread counts. A peer on this machine kind (ik_llama.cpp, experts on the CPU)
read its experts from ordinary memory at ~114 GB/s where our plain read of tier 1 gave 45-71: if the
other memories read faster, the remedy is where tier 1 lives, not the kernel.

Run: `python -m benchmarks.host_read_probe --out DIR [--experts 8] [--threads 8,12,16]`;
prints one line per (memory, threads, reader) and writes DIR/host_read_probe.jsonl.
"""

from __future__ import annotations

import argparse
import json
import mmap
from pathlib import Path

import numpy as np

from benchmarks.common import machine
from benchmarks.host_kernels import SHAPES, pinned_pool, plain_read, timed
from strata_jax.ops import host_experts, host_kernel


def _copy_into(views: dict[str, np.ndarray], huge: bool) -> dict[str, np.ndarray]:
    """The views' bytes in new host memory: numpy's allocator, or an anonymous mapping
    advised MADV_HUGEPAGE (kept alive by the arrays that view it)."""
    out = {}
    for name, v in views.items():
        if not huge:
            out[name] = np.array(v)
            continue
        buf = mmap.mmap(-1, v.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
        a = np.frombuffer(buf, dtype=v.dtype).reshape(v.shape)
        a[...] = v
        out[name] = a
    return out


def _system() -> dict[str, str]:
    info = {}
    for key, path in (("thp", "/sys/kernel/mm/transparent_hugepage/enabled"),
                      ("thp_defrag", "/sys/kernel/mm/transparent_hugepage/defrag")):
        try:
            info[key] = Path(path).read_text().strip()
        except OSError:
            info[key] = "unknown"
    return info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-8x7b")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")],
                    default=[8, 12, 16])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    d, f = SHAPES[args.shape]
    tier = host_experts.register(pinned_pool(d, f, args.experts))
    pinned = host_experts.tier(tier).views
    memories = {"pinned (tier 1)": pinned, "numpy": _copy_into(pinned, False),
                "anonymous, THP advised": _copy_into(pinned, True)}
    nbytes = sum(v[0].nbytes for v in pinned.values())
    x = np.random.default_rng(0).normal(0, 1, (1, d)).astype(host_kernel.BF16)
    base = {"shape": args.shape, "expert_bytes": nbytes, "system": _system(),
            "isa": host_kernel.isa(), "machine": machine()}
    print(f"system: {base['system']}, isa {base['isa']}", flush=True)
    rows = []
    for threads in args.threads:
        host_experts.set_threads(threads)
        for memory, views in memories.items():
            read = nbytes / plain_read(views, args.experts, args.calls, threads) / 1e9
            kernel = nbytes / timed(lambda i, v=views: host_experts.swiglu(
                v, i % args.experts, x), args.calls) / 1e9
            rows.append({**base, "memory": memory, "threads": threads,
                         "plain_read_gbps": read, "kernel_1row_gbps": kernel})
            print(f"threads {threads:2d}  {memory:24s} plain read {read:6.1f} GB/s   "
                  f"C kernel, 1 row {kernel:6.1f} GB/s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "host_read_probe.jsonl", "a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
