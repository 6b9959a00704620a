"""What the engine adds around its step program at one row (a diagnostic, issue 48 point 2).

On one engine built from a checkpoint: (a) `Engine.generate` of one prompt, ms per generated
token; (b) the engine's own decode program called back to back on the engine's state, params,
pool and tiers, with no scheduler, records or policy (what the step benchmark times), ms per
step; (c) a cProfile of (a), the functions with the most own time; (d) the host-side events
of a profiler trace of (a) (launches, transfers, waits: where the host blocks); (e) the
device's idle gaps in that trace (where the GPU waits for the host); (f) (b) in `VARIANTS`,
each adding one thing the engine does around the call. (a) - (b) is the engine's cost per
token.

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
import jax.numpy as jnp
import numpy as np

from benchmarks.common import device_gaps, host_event_times
from strata_jax.step import programs as step_programs
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.lab.bench import hardware_fingerprint

VARIANTS = ("plain", "plain_sync", "two_steps", "keywords", "record", "read_behind",
            "engine_step")
"""The raw loop's variants, each adding one thing the engine does around its program call
(so the one that costs shows as a jump): the call alone; the call then a wait for its
tokens (no step queued behind another); two decode steps in one program (ms per step: whether
the host's cost is per call or per kernel); with the engine's keyword arguments
(`resume=None, forced=None`); the record packed and both it and the tokens copied to the
host asynchronously; those read one step behind (the scheduler's pipelining); the engine's
own `step` and `read` (heat, policy, counters; no scheduler)."""


def _program_ms(engine: Engine, steps: int, variant: str = "plain") -> float:
    """ms per decode step of the engine's program called back to back (its state carried),
    in one of the `VARIANTS`."""
    if variant == "engine_step":
        return _engine_step_ms(engine, steps)
    program = _two_steps if variant == "two_steps" else engine._decode
    if variant == "two_steps":
        steps //= 2
    args = (engine.cfg, engine.plan, engine.params)
    keywords = ({} if variant in ("plain", "plain_sync", "two_steps")
                else {"resume": None, "forced": None})
    state, behind = engine.state, None
    calls = []

    def one(state, behind):
        t0 = time.perf_counter()
        state, out, pool = program(*args, engine.residency.pool, engine._tiers(), state,
                                   **keywords)
        calls.append(time.perf_counter() - t0)
        if variant == "plain_sync":
            jax.block_until_ready(out.tokens)
        if pool is not None:
            engine.residency.pool = pool
        if variant in ("record", "read_behind"):
            packed = step_programs.pack_record(out.record)
            packed.copy_to_host_async()
            out.tokens.copy_to_host_async()
            if variant == "read_behind" and behind is not None:
                np.asarray(behind[0]), np.asarray(behind[1])
            behind = (packed, out.tokens)
        return state, out, behind

    for _ in range(3):
        state, out, behind = one(state, behind)
    jax.block_until_ready(out.tokens)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, out, behind = one(state, behind)
    jax.block_until_ready(out.tokens)
    engine.state = state
    per = 2 if variant == "two_steps" else 1
    CALL_MS[variant] = 1e3 * float(np.mean(calls[3:])) / per
    return 1e3 * (time.perf_counter() - t0) / steps / per


def _two(cfg, plan, params, pool, tiers, state):
    """Two decode steps of the engine's program in one (a resident plan: no pool returned)."""
    state, first, _ = step_programs.decode_step(cfg, plan, params, pool, tiers, state)
    state, second, pool = step_programs.decode_step(cfg, plan, params, pool, tiers, state)
    return state, second.replace(tokens=jnp.stack([first.tokens, second.tokens])), pool


_two_steps = jax.jit(_two, static_argnames=("cfg", "plan"), donate_argnames=("state",),
                     compiler_options=step_programs.COMPILER_OPTIONS)


CALL_MS: dict[str, float] = {}
"""Per variant: the mean host time of the program call alone, ms (where it exceeds the
device's step, the host's launch binds)."""


def _engine_step_ms(engine: Engine, steps: int) -> float:
    """ms per `Engine.step` with the previous step's tokens read after it (the scheduler's
    order), the scheduler itself left out."""
    result = engine.step()
    jax.block_until_ready(result.tokens)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = engine.step()
        engine.read(result)
        result = nxt
    engine.read(result)
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
        gaps = device_gaps(lambda: engine.generate(prompt, 32))
        engine.generate(prompt, 4)  # a live row for the raw program's steps
        variants = {v: _program_ms(engine, args.new, v) for v in VARIANTS}
        program_ms = variants["plain"]
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    row = {"checkpoint": args.ckpt, "hbm": args.hbm, "new": args.new,
           "engine_ms_per_token": engine_ms, "program_ms_per_step": program_ms,
           "engine_over_program": engine_ms / program_ms, "variants_ms_per_step": variants,
           "call_ms": CALL_MS,
           "device_gaps": {k: v for k, v in gaps.items() if k != "largest"},
           "fingerprint": hardware_fingerprint()}
    print(json.dumps({k: v for k, v in row.items() if k != "fingerprint"}))
    print("the raw loop's variants, ms per step (the call alone):", ", ".join(
        f"{k} {v:.3f} ({CALL_MS.get(k, float('nan')):.3f})" for k, v in variants.items()))
    print("device of a 32-token generate: busy {busy_ms:.2f} ms of {span_ms:.2f} ms, {gaps} "
          "gaps over 20 us ({idle_ms:.2f} ms idle); the largest:".format(**gaps))
    for g in gaps["largest"]:
        print(f"  {g['us']:9.1f} us  after {g['after']}  before {g['before']}")
    print("host events of a 32-token generate (profiler trace), longest first:")
    for name, e in host.items():
        print(f"  {e['us'] / 1e3:9.2f} ms  x{e['count']:<5g} {name}")
    print(text.getvalue())
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "engine_overhead.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
