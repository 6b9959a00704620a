"""GPU diagnostic: the MLA decode kernel (`strata_jax/ops/mla_kernel.py`) against XLA's path.

DeepSeek-V3 attention dims (H=128 heads, kv_lora_rank r=512, rope dim dr=64, bf16 cache),
rows of the full cache length S. For each (batch, seq) it first checks the kernel against the
XLA path (max |kernel - xla| / max |xla|), then times (a) `mla_decode` and (b) the einsums of
`decoder.attend_mla` at T=1 (scores over the whole cache, softmax, probabilities rounded to bf16,
the mix), each as the median of `--reps` calls after a warm-up, blocked on with
jax.block_until_ready. A call is one jitted program that runs the op over `copies` distinct
caches in turn (together more than twice an H100's 50 MB L2, so none is read from L2) and is
timed per op: one dispatch per program, not per op. The bound is the cache bytes a step must
read, B * S * (r + dr) * 2, over `benchmarks.common.hbm_bandwidth()`'s read GB/s; ratio =
bound ms / kernel ms (1.0: the kernel reads at the HBM read rate). The kernel's device time
per op (profiler, split kernel and combine) is printed beside the wall time.

Prints one JSON line per measurement (and appends them to `--out` if given). `--sweep` times
each tile candidate (block_h x block_s x splits x num_warps; failures such as shared memory
overruns are printed and skipped) at every shape and prints the best: that is how to pick
`MlaTiles`' defaults on a new GPU. `--quick` runs tiny dims in Pallas interpret mode on a CPU:
a smoke test of this script, its timings meaningless.

    python -m benchmarks.mla_decode --batch 1,16 --seq 4096,32768 --sweep
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import device_kernel_times, hbm_bandwidth, machine, median_time
from strata_jax.ops.layers import NEG_INF, einsum_f32
from strata_jax.ops.mla_kernel import (
    MlaTiles,
    bytes_read,
    mla_decode,
    mla_misfit,
    mla_splits_for,
    mla_tiles_for,
)

L2_BYTES = 50 << 20  # an H100's L2; the copies of a cache together exceed twice this
MAX_COPIES = 32


@dataclass(frozen=True, kw_only=True)
class Dims:
    """Attention dims of one run."""

    heads: int
    rank: int
    rope_dim: int


DEEPSEEK_V3 = Dims(heads=128, rank=512, rope_dim=64)
TINY = Dims(heads=16, rank=64, rope_dim=16)  # --quick, interpret mode
SWEEP = dict(block_h=(16, 32, 64), block_s=(32, 64, 128), num_warps=(4, 8))
SPLIT_FACTORS = (0.5, 1, 2)  # times the picked splits


def _inputs(key, batch: int, seq: int, dims: Dims, copies: int):
    """q (q_lat, q_rope) and `copies` caches (latent, k_rope), bf16 normal, full lengths."""
    kq, kr, *kc = jax.random.split(key, 2 + copies)
    normal = lambda k, *shape: jax.random.normal(k, shape, jnp.bfloat16)  # noqa: E731
    q = (normal(kq, batch, dims.heads, dims.rank), normal(kr, batch, dims.heads, dims.rope_dim))
    caches = [(normal(k1, batch, seq, dims.rank), normal(k2, batch, seq, dims.rope_dim))
              for k1, k2 in (jax.random.split(k) for k in kc)]
    return q, caches, jnp.full((batch,), seq, jnp.int32)


def xla_attend(q_lat, q_rope, latent, k_rope, lengths, scale: float):
    """`decoder.attend_mla`'s attention core at T=1, its einsums as written there (the cache
    without its head axis): [B, 1, H, r] in the latent's dtype."""
    q_lat, q_rope = q_lat[:, None], q_rope[:, None]
    scores = (einsum_f32("bthr,bsr->bhts", q_lat, latent)
              + einsum_f32("bthd,bsd->bhts", q_rope, k_rope))
    mask = (jnp.arange(latent.shape[1])[None, :] < lengths[:, None])[:, None]  # [B, T, S]
    scores = jnp.where(mask[:, None], scores * scale, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(latent.dtype)
    return jnp.einsum("bhts,bsr->bthr", probs, latent)


def _kernel(tiles: dict, interpret: bool) -> Callable:
    return lambda *a: mla_decode(*a, **tiles, interpret=interpret)


def _program(op: Callable, scale: float) -> Callable:
    """One jitted program running `op` over every cache in turn."""
    return jax.jit(lambda q, caches, lengths: [op(*q, *c, lengths, scale) for c in caches])


def _ms_per_op(op: Callable, q, caches, lengths, scale: float, reps: int) -> float:
    run = _program(op, scale)
    call = lambda: jax.block_until_ready(run(q, caches, lengths))  # noqa: E731
    return median_time(call, reps=reps, warmup=3) / len(caches) * 1e3


def _device_us(op: Callable, q, caches, lengths, scale: float) -> dict[str, float]:
    """Device microseconds per op of each GPU kernel `op` runs (empty off the GPU)."""
    if jax.default_backend() != "gpu":
        return {}
    run = _program(op, scale)
    kernels = device_kernel_times(lambda: jax.block_until_ready(run(q, caches, lengths)))
    return {name: round(k["us"] / len(caches), 2) for name, k in kernels.items()}


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def _emit(row: dict, out: Path | None) -> None:
    line = json.dumps(row, default=str)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(line + "\n")


def _candidates(batch: int, seq: int, dims: Dims) -> list[dict]:
    """The sweep's tiles that fit: SWEEP's product, splits at SPLIT_FACTORS of the picked."""
    found = []
    for bh, bs, warps in itertools.product(*SWEEP.values()):
        tiles = MlaTiles(block_h=bh, block_s=bs, num_warps=warps)
        if mla_misfit(dims.heads, dims.rank, dims.rope_dim, seq, tiles) is not None:
            continue
        picked = mla_splits_for(batch, dims.heads, dims.rank, dims.rope_dim, seq, bh, bs)
        for splits in sorted({max(1, int(picked * f)) for f in SPLIT_FACTORS}):
            found.append({**asdict(tiles), "splits": splits})
    return found


def _measure(batch: int, seq: int, dims: Dims, args, read_gbps: float | None,
             info: dict) -> None:
    nbytes = bytes_read(batch, seq, dims.rank, dims.rope_dim)
    copies = min(MAX_COPIES, max(1, math.ceil(2 * L2_BYTES / nbytes)))
    q, caches, lengths = _inputs(jax.random.PRNGKey(seq + batch), batch, seq, dims, copies)
    scale = 192**-0.5  # DeepSeek-V3's head_dim (YaRN's mscale aside): timings do not depend on it
    interpret = jax.default_backend() != "gpu"
    tiles = asdict(mla_tiles_for(batch, dims.heads, dims.rank, dims.rope_dim, seq))
    kernel = _kernel(tiles, interpret)
    base = {"device": info["device"], "batch": batch, "seq": seq, **asdict(dims),
            "latent_bytes": nbytes, "copies": copies}
    want = xla_attend(*q, *caches[0], lengths, scale)[:, 0]
    err = _rel_err(kernel(*q, *caches[0], lengths, scale), want)
    _emit({"kind": "check", **base, "tiles": tiles, "rel_err_vs_xla": err}, args.out)
    kernel_ms = _ms_per_op(kernel, q, caches, lengths, scale, args.reps)
    xla_ms = _ms_per_op(xla_attend, q, caches, lengths, scale, args.reps)
    bound_ms = nbytes / (read_gbps * 1e9) * 1e3 if read_gbps else None
    _emit({"kind": "time", **base, "tiles": tiles, "kernel_ms": kernel_ms, "xla_ms": xla_ms,
           "read_GBps": read_gbps, "bound_ms": bound_ms,
           "ratio": bound_ms / kernel_ms if bound_ms else None,
           "xla_ratio": bound_ms / xla_ms if bound_ms else None,
           "kernel_device_us": _device_us(kernel, q, caches, lengths, scale),
           "rel_err_vs_xla": err}, args.out)
    if args.sweep:
        _sweep(batch, seq, dims, q, caches, lengths, scale, want, base, bound_ms, args)


def _sweep(batch, seq, dims, q, caches, lengths, scale, want, base, bound_ms, args) -> None:
    interpret = jax.default_backend() != "gpu"
    timed = []
    for tiles in _candidates(batch, seq, dims):
        kernel = _kernel(tiles, interpret)
        row = {"kind": "sweep", **base, "tiles": tiles}
        try:
            err = _rel_err(kernel(*q, *caches[0], lengths, scale), want)
            ms = _ms_per_op(kernel, q, caches, lengths, scale, args.reps)
        except Exception as e:  # e.g. out of shared memory: report, keep sweeping
            _emit({**row, "error": repr(e)[:300]}, args.out)
            continue
        timed.append({**row, "kernel_ms": ms, "rel_err_vs_xla": err,
                      "ratio": bound_ms / ms if bound_ms else None})
        _emit(timed[-1], args.out)
    if timed:
        _emit({**min(timed, key=lambda r: r["kernel_ms"]), "kind": "sweep_best"}, args.out)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=_ints, default=[1, 16], help="rows, e.g. 1,16")
    parser.add_argument("--seq", type=_ints, default=[4096, 32768], help="cache lengths S")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per variant")
    parser.add_argument("--sweep", action="store_true", help="time the tile candidates too")
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines here")
    parser.add_argument("--quick", action="store_true",
                        help="tiny dims, few reps (Pallas interpret mode off the GPU)")
    args = parser.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    if interpret and not args.quick:
        sys.exit("mla_decode: a GPU diagnostic; on this backend only --quick runs")
    dims = TINY if args.quick else DEEPSEEK_V3
    if args.quick:
        args.batch, args.seq, args.reps = [1, 2], [256], 2
    info = machine()
    bw = None if args.quick else hbm_bandwidth()
    _emit({"kind": "machine", **info, "hbm": bw}, args.out)
    for batch, seq in itertools.product(args.batch, args.seq):
        _measure(batch, seq, dims, args, bw["read"] if bw else None, info)


if __name__ == "__main__":
    main()
