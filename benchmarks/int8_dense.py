"""GPU diagnostic: the int8 dense kernel (`strata_jax/ops/int8_kernel.py`) at decode row counts.

For Mixtral-8x7B dense shapes (wqkv 4096x6144, wo 4096x4096, and 4096x14336) and M in 1, 4, 16
rows, times (a) the XLA formula `model.linear` uses, (x @ w.astype(x.dtype)) * scale, (b)
`int8_matmul` with `int8_tiles_for`'s tiles, (c) a bf16 `x @ w` of the same shape and (d) a plain
read of the int8 bytes (a sum of them as int32). Each is the median, over many runs, of one
jitted program of CHAIN calls, each on the last one's output (a device rate from one dispatch:
the idea of `strata_runtime.lab.bench._chained`), each call on its own copy of the weights so that
none is read from L2. Every call includes the same glue (the next x from a row mean of y).
Prints us per call and GB/s of the weight bytes each variant reads (int8 + scales, or bf16),
checks the kernel against the XLA formula (max abs difference over max abs), then sweeps tile
settings at one row on 4096x6144 and prints the best. Writes `int8_dense.jsonl` to `--out`.

~2-3 min on an H100. `--quick` runs tiny shapes (in Pallas interpret mode on a CPU: a smoke
test of this script, its timings meaningless).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.common import machine
from strata_jax.ops.int8_kernel import Int8Tiles, int8_fits, int8_matmul, int8_tiles_for

CHAIN = 8  # calls per jitted program, each on its own weight copy (8 x 16.8 MB > 2 x L2)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one run measures."""

    shapes: tuple[tuple[str, int, int], ...]
    """(name, K, N) of each matrix."""
    rows: tuple[int, ...]
    """Activation row counts M."""
    sweep_shape: tuple[str, int, int]
    """The matrix the tile sweep runs on, at one row."""
    sweep: tuple[Int8Tiles, ...]
    """Tile candidates (those that do not fit the sweep shape are skipped)."""
    chain: int
    """Calls per timed program, each on its own weight copy."""
    reps: int
    """Timed samples per variant (the median is reported)."""
    inner: int
    """Programs dispatched back to back per sample (host overhead spread over them)."""


def _sweep(bks: Sequence[int], bns: Sequence[int], splits: Sequence[int]) -> tuple:
    return tuple(Int8Tiles(bk=bk, bn=bn, split_k=s)
                 for bk, bn, s in itertools.product(bks, bns, splits))


FULL = Plan(shapes=(("wqkv", 4096, 6144), ("wo", 4096, 4096), ("4096x14336", 4096, 14336)),
            rows=(1, 4, 16), sweep_shape=("wqkv", 4096, 6144),
            sweep=_sweep((128, 256, 512), (32, 64, 128), (1, 2, 4, 8)),
            chain=CHAIN, reps=25, inner=4)
QUICK = Plan(shapes=(("tiny", 256, 192), ("tiny square", 256, 256)), rows=(1, 4),
             sweep_shape=("tiny", 256, 192), sweep=_sweep((64,), (32, 64), (1, 2)),
             chain=2, reps=2, inner=1)


def _chained_us(step: Callable, x0, copies: list[tuple], plan: Plan) -> float:
    """Median microseconds per call of `step(x, *copy) -> next x`, timed as one jitted program
    that chains the calls over `copies`, `plan.inner` programs per sample."""
    @jax.jit
    def run(x, copies):
        for args in copies:
            x = step(x, *args)
        return x

    for _ in range(3):  # compile, then warm
        jax.block_until_ready(run(x0, copies))
    samples = []
    for _ in range(plan.reps):
        t0 = time.perf_counter()
        outs = [run(x0, copies) for _ in range(plan.inner)]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - t0) / plan.inner / len(copies))
    return statistics.median(samples) * 1e6


def _next_x(x, y):
    """The next call's input: depends on all of y (none of it is dead code), stays bounded."""
    return x + jnp.tanh(jnp.mean(y.astype(jnp.float32), axis=1, keepdims=True)).astype(x.dtype)


def _weights(key, k: int, n: int, copies: int) -> tuple[list, list, list]:
    """`copies` int8 matrices in [-127, 127] with bf16 scales (outputs of order one), and each
    one's bf16 dequantized copy."""
    ints, bf16s = [], []
    for one in jax.random.split(key, copies):
        kw, ks = jax.random.split(one)
        w = jax.random.randint(kw, (k, n), -127, 128, jnp.int8)
        scale = (jax.random.uniform(ks, (n,), jnp.float32, 0.5, 1.5)
                 / (73 * k**0.5)).astype(jnp.bfloat16)
        ints.append((w, scale))
        bf16s.append(((w.astype(jnp.float32) * scale).astype(jnp.bfloat16),))
    reads = [(w,) for w, _ in ints]
    return ints, bf16s, reads


def _xla(x, w, scale):
    return (x @ w.astype(x.dtype)) * scale.astype(x.dtype)


def _kernel(tiles: Int8Tiles, interpret: bool) -> Callable:
    return lambda x, w, scale: int8_matmul(x, w, scale, tiles=tiles, interpret=interpret)


def _read(acc, w):  # adds the last sum to every byte: a full read per call
    return jnp.sum(w.astype(jnp.int32) + acc)


def _rel_err(got, want) -> float:
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.abs(got - want).max() / jnp.abs(want).max())


def _measure_shape(name: str, k: int, n: int, plan: Plan, interpret: bool,
                   rows: list[dict]) -> None:
    ints, bf16s, reads = _weights(jax.random.PRNGKey(k + n), k, n, plan.chain)
    int8_bytes, bf16_bytes = k * n + 2 * n, 2 * k * n
    tiles = int8_tiles_for(k, n)
    base = {"kind": "time", "shape": name, "k": k, "n": n}
    read_us = _chained_us(_read, jnp.zeros((), jnp.int32), reads, plan)
    rows.append({**base, "m": None, "variant": "read int8", "us": read_us,
                 "GBps": k * n / read_us / 1e3})
    for m in plan.rows:
        x0 = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
        kernel = _kernel(tiles, interpret)
        variants = {"xla int8": (_xla, ints, int8_bytes),
                    "kernel int8": (kernel, ints, int8_bytes),
                    "xla bf16": (lambda x, w: x @ w, bf16s, bf16_bytes)}
        for variant, (fn, copies, nbytes) in variants.items():
            us = _chained_us(lambda x, *a, fn=fn: _next_x(x, fn(x, *a)), x0, copies, plan)
            rows.append({**base, "m": m, "variant": variant, "us": us,
                         "GBps": nbytes / us / 1e3,
                         "tiles": str(tiles) if variant.startswith("kernel") else None})
        err = _rel_err(kernel(x0, *ints[0]), _xla(x0, *ints[0]))
        rows.append({**base, "kind": "check", "m": m, "rel_err_vs_xla": err})


def _sweep_tiles(plan: Plan, interpret: bool, rows: list[dict]) -> None:
    name, k, n = plan.sweep_shape
    ints, _, _ = _weights(jax.random.PRNGKey(1), k, n, plan.chain)
    x0 = jax.random.normal(jax.random.PRNGKey(2), (1, k), jnp.bfloat16)
    want = _xla(x0, *ints[0])
    for tiles in (t for t in plan.sweep if int8_fits(k, n, t)):
        kernel = _kernel(tiles, interpret)
        row = {"kind": "sweep", "shape": name, "k": k, "n": n, "m": 1, "tiles": str(tiles),
               "programs": n // tiles.bn * tiles.split_k}
        try:
            err = _rel_err(kernel(x0, *ints[0]), want)
            us = _chained_us(lambda x, w, s, f=kernel: _next_x(x, f(x, w, s)), x0, ints, plan)
        except Exception as e:  # e.g. shared memory: report, keep sweeping
            rows.append({**row, "error": repr(e)[:300]})
            print(f"  {tiles}: failed {repr(e)[:120]}", flush=True)
            continue
        rows.append({**row, "us": us, "GBps": (k * n + 2 * n) / us / 1e3, "rel_err_vs_xla": err})
        print(f"  {tiles}: {us:8.2f} us  {rows[-1]['GBps']:7.0f} GB/s  err {err:.1e}",
              flush=True)


def _table(rows: list[dict]) -> str:
    cols = ("xla int8", "kernel int8", "xla bf16")
    lines = [f"{'shape':<11} {'M':>3} " + " ".join(f"{c + ' us (GB/s)':>22}" for c in cols)
             + f" {'read int8 us (GB/s)':>22} {'kernel/xla':>10} {'err':>8}"]
    times = {(r["shape"], r["m"], r["variant"]): r for r in rows if r["kind"] == "time"}
    errs = {(r["shape"], r["m"]): r["rel_err_vs_xla"] for r in rows if r["kind"] == "check"}
    for shape, m in errs:
        cells = [times[(shape, m, c)] for c in cols] + [times[(shape, None, "read int8")]]
        speedup = cells[0]["us"] / cells[1]["us"]
        lines.append(f"{shape:<11} {m:>3} " + " ".join(
            f"{r['us']:>12.2f} ({r['GBps']:>6.0f})" for r in cells)
            + f" {speedup:>10.2f} {errs[(shape, m)]:>8.1e}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                        help="folder for int8_dense.jsonl (default: benchmarks/results)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, few reps (Pallas interpret mode off the GPU)")
    args = parser.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    if interpret and not args.quick:
        sys.exit("int8_dense: a GPU diagnostic; on this backend only --quick runs")
    plan = QUICK if args.quick else FULL
    info = machine()
    rows: list[dict] = []
    for name, k, n in plan.shapes:
        print(f"{name} {k}x{n}, tiles {int8_tiles_for(k, n)}", flush=True)
        _measure_shape(name, k, n, plan, interpret, rows)
    print(_table(rows), flush=True)
    print(f"tile sweep, M=1, {plan.sweep_shape[0]} {plan.sweep_shape[1]}x{plan.sweep_shape[2]}:",
          flush=True)
    _sweep_tiles(plan, interpret, rows)
    timed = [r for r in rows if r["kind"] == "sweep" and "us" in r]
    if timed:
        best = min(timed, key=lambda r: r["us"])
        print(f"best: {best['tiles']} {best['us']:.2f} us ({best['GBps']:.0f} GB/s)")
        rows.append({**best, "kind": "sweep_best"})
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "int8_dense.jsonl"
    with path.open("w") as f:
        f.write(json.dumps({"kind": "machine", **info, "plan": dataclasses.asdict(plan)},
                           default=str) + "\n")
        for row in rows:
            f.write(json.dumps({"device": info["device"], **row}) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
