"""Where a long prompt's prefill time goes (a diagnostic, issue 48 point 3).

On one engine built from a checkpoint: the wall time of `Engine.generate` of one prompt of
`--prompt-len` tokens with one new token (the prefill and one step), after a compiling run;
then the GPU kernels of one such call from a profiler trace, slowest first, and their sum
beside the wall time (the gap: the host, or the device idle between programs).

    python -m benchmarks.prefill_profile CKPT [--prompt-len 2048] [--hbm SIZE] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import device_kernel_times
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.lab.bench import hardware_fingerprint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--hbm", default=None)
    ap.add_argument("--chunk", type=int, default=None, help="EngineConfig.prefill_chunk")
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    config = EngineConfig(batch_capacity=1, max_len=args.prompt_len + 64, hbm_budget=args.hbm,
                          prefill_chunk=args.chunk)
    prompt = [[3 + (7 * i) % 500 for i in range(args.prompt_len)]]
    with Engine.from_checkpoint(args.ckpt, config) as engine:
        engine.generate(prompt, 1)  # compiles
        t0 = time.perf_counter()
        engine.generate(prompt, 1)
        wall_ms = 1e3 * (time.perf_counter() - t0)
        kernels = device_kernel_times(lambda: engine.generate(prompt, 1), reps=1)
        chunk = engine.prefill_chunk
        fetched = engine.stats()["by_phase"]["prefill"]["totals"]["fetched"]
    device_ms = sum(k["us"] for k in kernels.values()) / 1e3
    row = {"checkpoint": args.ckpt, "hbm": args.hbm, "prompt_len": args.prompt_len,
           "chunk": chunk, "wall_ms": wall_ms, "prefill_tok_s": args.prompt_len / wall_ms * 1e3,
           "device_ms": device_ms, "experts_fetched_in_all_runs": fetched,
           "top": dict(list(kernels.items())[:args.top]), "fingerprint": hardware_fingerprint()}
    print(json.dumps({k: v for k, v in row.items() if k not in ("top", "fingerprint")}))
    for name, k in row["top"].items():
        print(f"  {k['us'] / 1e3:9.2f} ms  x{k['count']:<6g} {name}")
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "prefill_profile.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
