"""How long the ledger's compiles take, one after another against side by side.

The ledger sizes the workspace by compiling a layout's three step programs (decode greedy,
decode sampled, the largest prefill chunk: runtime/residency/workspace.py); on the GPU machine this
was
most of an engine's start-up. This lowers the programs of one engine configuration and
compiles them, alternately, one after another and on threads (as `workspace._measure` does),
`--repeats` times each, with no compilation cache (the in-process caches cleared and the
programs lowered again before each run), and writes one JSON line per run.

    python -m benchmarks.ledger_compile --checkpoint /tmp/strata_seed6_bf16 --out $OUT \
        --hbm 24GB --host-mem 12GB --batch 1
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax

from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.step import programs as step
from strata_runtime.engine import plan as engine
from strata_runtime.engine.config import EngineConfig
from strata_runtime.residency import workspace


def _lowered(reader: CheckpointReader, config: EngineConfig) -> list[jax.stages.Lowered]:
    shapes = workspace.held_expert_shapes(reader, engine.host_dequantizes(config, reader),
                                          engine.slot_tile(reader, config))
    ledger = engine._ledger(reader, config, 0, check=False)
    plan = step.StepPlan(staging=ledger.staging_slots, predictor=config.predictor,
                         row_chunks=config.row_chunks, int4_tiles=config.int4_tiles)
    return workspace.lowered_programs(reader, plan, batch=config.batch_capacity,
                                      max_len=config.max_len, shapes=shapes,
                                      chunk=step.default_prefill_chunk(config.max_len))


def _timed(lowered: list[jax.stages.Lowered], threads: bool) -> float:
    t0 = time.perf_counter()
    if threads:
        with ThreadPoolExecutor(len(lowered)) as pool:
            list(pool.map(lambda lo: lo.compile(), lowered))
    else:
        for lo in lowered:
            lo.compile()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", default=".")
    ap.add_argument("--hbm", default="24GB")
    ap.add_argument("--host-mem", default="12GB")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    reader = CheckpointReader(Path(args.checkpoint))
    config = EngineConfig(hbm_budget=args.hbm, host_budget=args.host_mem, policy="static",
                          cache_fraction=0.0, batch_capacity=args.batch, max_len=args.max_len)
    for r in range(args.repeats):
        for threads in ((False, True) if r % 2 == 0 else (True, False)):
            jax.clear_caches()  # a compiled Lowered is remembered: lower again, compile again
            t0 = time.perf_counter()
            lowered = _lowered(reader, config)
            row = {"checkpoint": args.checkpoint, "batch": args.batch, "max_len": args.max_len,
                   "hbm": args.hbm, "host": args.host_mem, "programs": len(lowered),
                   "lower_s": time.perf_counter() - t0, "threads": threads, "repeat": r,
                   "compile_s": _timed(lowered, threads), "host_cores": os.cpu_count(),
                   "device": jax.devices()[0].device_kind}
            print(json.dumps(row), flush=True)
            with open(Path(args.out) / "ledger_compile.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
