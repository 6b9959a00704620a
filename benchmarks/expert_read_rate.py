"""How fast one host thread reads experts from a checkpoint, with and without the sha256 check.

The engine's start-up fills the expert pools through `CheckpointReader.read_expert` (read and
verified against the manifest) on several threads (`Engine._read`); this times that read, the
same read unverified and the hash alone, from the page cache (each setting reads the same
experts once untimed first), at each thread count, and writes one JSON line per setting.

    python -m benchmarks.expert_read_rate --checkpoint CKPT --out DIR [--threads 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from strata_jax.formats.checkpoint import CheckpointReader, _sha256


def _rate(reader: CheckpointReader, keys: list[tuple[int, int]], threads: int,
          verify: bool) -> float:
    def one(key: tuple[int, int]) -> int:
        return sum(reader.read_expert(*key, kind, verify=verify).nbytes
                   for kind in reader.expert_specs)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, keys))  # into the page cache
        t0 = time.perf_counter()
        total = sum(pool.map(one, keys))
    return total / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", default=".")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--experts", type=int, default=16, help="experts read per thread")
    args = ap.parse_args()
    reader = CheckpointReader(Path(args.checkpoint))
    cfg = reader.config
    every = [(layer, e) for layer in range(cfg.num_layers) for e in range(cfg.num_experts)]
    kind = next(iter(reader.expert_specs))
    array = reader.read_expert(0, 0, kind)
    t0 = time.perf_counter()
    for _ in range(5):
        _sha256(array)
    head = {"checkpoint": args.checkpoint, "host_cores": os.cpu_count(),
            "sha256_gbps": 5 * array.nbytes / (time.perf_counter() - t0) / 1e9}
    for threads in map(int, args.threads.split(",")):
        keys = every[: args.experts * threads]
        for verify in (True, False):
            row = {**head, "threads": threads, "verify": verify, "experts": len(keys),
                   "gbps": _rate(reader, keys, threads, verify)}
            print(json.dumps(row), flush=True)
            with open(Path(args.out) / "expert_read_rate.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
