"""Where a resident decode step's device time goes: the kernels of one `step.decode` of the
synthetic Mixtral-8x7B shape (8 layers, random weights), by device time, beside the step's
wall time. The diagnostic behind the resident rows of step_decode.md."""

from __future__ import annotations

import argparse
import json
import time

import jax

from benchmarks.common import device_kernel_times
from benchmarks.step_decode import (
    SHAPES,
    int4_tile,
    live_state,
    random_experts,
    random_params,
    resident_page,
)
from strata_jax.step import programs as step


def profile(shape: str, fmt: str, batch: int, top: int, unroll: bool) -> dict:
    cfg = SHAPES[shape]
    params = random_params(cfg, jax.random.key(0))
    pool = random_experts(cfg, fmt, jax.random.key(1), int4_tile(cfg, "auto") if fmt == "int4"
                          else None)
    tiers = step.resident_tiers(resident_page(cfg))
    plan = step.StepPlan(unroll=unroll)
    box = {"state": live_state(cfg, batch, 256)}

    def one():
        box["state"], out, _ = step.decode(cfg, plan, params, pool, tiers, box["state"])
        jax.block_until_ready(out.tokens)

    for _ in range(3):
        one()
    t0 = time.perf_counter()
    for _ in range(20):
        one()
    wall = (time.perf_counter() - t0) / 20
    kernels = device_kernel_times(one, reps=5)
    device = sum(k["us"] for k in kernels.values())
    ranked = dict(list(kernels.items())[:top])
    return {"format": fmt, "batch": batch, "unroll": unroll, "wall_ms": wall * 1e3,
            "device_ms": device / 1e3, "kernels": len(kernels), "top": ranked}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="int4:1,bf16:1,int4:16")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--unroll", action="store_true", help="StepPlan(unroll=True)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-8x7b")
    args = p.parse_args()
    for row in args.rows.split(","):
        fmt, batch = row.split(":")
        print(json.dumps(profile(args.shape, fmt, int(batch), args.top, args.unroll)), flush=True)


if __name__ == "__main__":
    main()
