"""How fast round-to-nearest int4 quantizes: one thread on one expert-sized matrix
(`quant.quantize_int4_rtn`, bf16 in), and, with --checkpoint, a whole `quantize_checkpoint`
of that checkpoint into int4-rtn experts (reading, hashing, the experts on the cores, writing).
One JSON line per figure, with the machine and the git commit.

    python -m benchmarks.quantize_rate [--checkpoint CKPT] [--out DIR] [--shape 4096,2560]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from benchmarks.common import machine
from strata_jax.formats import quant
from strata_jax.tools.quantize import quantize_checkpoint
from strata_runtime.lab.bench import git_commit


def matrix_rate(k: int, n: int, reps: int = 3) -> dict[str, float]:
    """bf16 GB/s through `quantize_int4_rtn` on one thread, best of `reps` over 8 matrices."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, k, n), np.float32).astype(ml_dtypes.bfloat16)
    quant.quantize_int4_rtn(w[0])  # untimed
    best = np.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        for m in w:
            quant.quantize_int4_rtn(m)
        best = min(best, time.perf_counter() - t0)
    return {"bf16_gbps": w.nbytes / best / 1e9, "ms_per_matrix": best / len(w) * 1e3}


def checkpoint_seconds(src: str) -> float:
    """Seconds of `quantize_checkpoint(src, int4-rtn experts)` into a temporary folder beside
    it (the source read once untimed first, so both runs read from the page cache)."""
    with tempfile.TemporaryDirectory(dir=Path(src).parent) as tmp:
        quantize_checkpoint(src, Path(tmp) / "warm", experts="int4-rtn", dense="none",
                            progress=False)
        shutil.rmtree(Path(tmp) / "warm")
        t0 = time.perf_counter()
        quantize_checkpoint(src, Path(tmp) / "q", experts="int4-rtn", dense="none",
                            progress=False)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="4096,2560", help="K,N of the matrix")
    args = ap.parse_args()
    k, n = map(int, args.shape.split(","))
    head = {"machine": machine(), "commit": (git_commit() or {}).get("commit")}
    rows = [{**head, "what": "quantize_int4_rtn, 1 thread", "shape": [k, n], **matrix_rate(k, n)}]
    if args.checkpoint:
        rows.append({**head, "what": "quantize_checkpoint int4-rtn", "checkpoint":
                     args.checkpoint, "seconds": checkpoint_seconds(args.checkpoint)})
    for row in rows:
        print(json.dumps(row), flush=True)
        with open(Path(args.out) / "quantize_rate.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
