"""What the engine adds around its step program at one row (a diagnostic, issue 48 point 2).

On one engine built from a checkpoint: (a) `Engine.generate` of one prompt, ms per generated
token; (b) the engine's own decode program called back to back on the engine's state, params,
pool and tiers, with no scheduler, records or policy (what the step benchmark times), ms per
step; (c) a cProfile of (a), the functions with the most own time; (d) the host-side events
of a profiler trace of (a) (launches, transfers, waits: where the host blocks). (a) - (b) is
the engine's cost per token.

    python -m benchmarks.engine_overhead CKPT [--new 128] [--hbm SIZE] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import jax

from benchmarks.common import host_event_times
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.lab.bench import hardware_fingerprint


def _program_ms(engine: Engine, steps: int) -> float:
    """ms per call of the engine's decode program back to back (its state carried)."""
    program = engine._decode
    args = (engine.cfg, engine.plan, engine.params)
    state = engine.state
    for _ in range(3):
        state, out, pool = program(*args, engine.residency.pool, engine._tiers(), state)
    jax.block_until_ready(out.tokens)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, out, pool = program(*args, engine.residency.pool, engine._tiers(), state)
        if pool is not None:
            engine.residency.pool = pool
    jax.block_until_ready(out.tokens)
    engine.state = state
    return 1e3 * (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--hbm", default=None)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    config = EngineConfig(batch_capacity=1, max_len=args.new + 64, hbm_budget=args.hbm)
    prompt = [[3 + i % 50 for i in range(32)]]
    with Engine.from_checkpoint(args.ckpt, config) as engine:
        engine.generate(prompt, 8)  # compiles
        t0 = time.perf_counter()
        engine.generate(prompt, args.new)
        engine_ms = 1e3 * (time.perf_counter() - t0) / args.new
        prof = cProfile.Profile()
        prof.enable()
        engine.generate(prompt, args.new)
        prof.disable()
        host = host_event_times(lambda: engine.generate(prompt, 32))
        engine.generate(prompt, 4)  # a live row for the raw program's steps
        program_ms = _program_ms(engine, args.new)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    row = {"checkpoint": args.ckpt, "hbm": args.hbm, "new": args.new,
           "engine_ms_per_token": engine_ms, "program_ms_per_step": program_ms,
           "engine_over_program": engine_ms / program_ms,
           "fingerprint": hardware_fingerprint()}
    print(json.dumps({k: v for k, v in row.items() if k != "fingerprint"}))
    print(text.getvalue())
    print("host events of a 32-token generate (profiler trace), longest first:")
    for name, e in host.items():
        print(f"  {e['us'] / 1e3:9.2f} ms  x{e['count']:<5g} {name}")
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "engine_overhead.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
