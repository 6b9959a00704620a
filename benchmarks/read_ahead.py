"""Read-ahead by heat (`EngineConfig.read_ahead`): does reading hot disk-only experts into tier 1
between steps save disk stalls, and for how many extra disk reads?

A skewed synthetic checkpoint (tiny shape, 4 layers) decoded at B=16 with 8 experts in HBM and
24 in tier 1 (the other 32 on disk), one engine per setting and prompt seed; the counts are
the decode's after a short warm-up. Tokens must be equal across settings (tier 1's content
never changes a bit). Writes read_ahead.jsonl and read_ahead.md under --out.

    python -m benchmarks.read_ahead --out benchmarks/results   # CPU, ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

import jax

from strata_jax.tools.synth import synthesize
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.lab.bench import synthetic_prompts, tokens_digest


def run(ckpt: Path, seed: int, read_ahead: int, hysteresis: float, new: int) -> dict:
    prompts = synthetic_prompts(512, 16, 16, seed)
    config = EngineConfig(batch_capacity=16, max_len=32 + new, resident_experts=8,
                          host_experts=24, policy="static", read_ahead=read_ahead,
                          hysteresis=hysteresis)
    with Engine.from_checkpoint(ckpt, config) as engine:
        engine.generate(prompts, 4)
        engine.reset_stats()
        tokens = engine.generate(prompts, new)
        s = engine.stats()
    return {"seed": seed, "read_ahead": read_ahead, "hysteresis": hysteresis,
            "stall_loads": s["disk_loads"], "read_ahead_loads": s["read_ahead_loads"],
            "resumed_layers": s["resumed_layers"], "tokens_sha256": tokens_digest(tokens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/strata_read_ahead_tiny"))
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--new", type=int, default=96)
    args = ap.parse_args()
    if not (args.checkpoint / "config.json").exists():
        synthesize("tiny", args.checkpoint, layers=4, skew=0.7, seed=0, progress=False)
    settings = [(0, 0.1), (1, 0.1), (2, 0.1), (8, 0.1), (2, 1.0)]
    rows = [run(args.checkpoint, seed, ra, hy, args.new)
            for ra, hy in settings for seed in range(args.seeds)]
    digests = {r["seed"]: set() for r in rows}
    for r in rows:
        digests[r["seed"]].add(r["tokens_sha256"])
    equal = all(len(d) == 1 for d in digests.values())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    head = (f"# Read-ahead by heat ({datetime.date.today()}, {jax.default_backend()}, jax "
            f"{jax.__version__}, commit {commit})\n\n"
            f"Tiny synthetic, 4 layers, skew 0.7, B=16, 8 experts in HBM, 24 in tier 1, 32 on "
            f"disk; {args.new} new tokens per prompt, {args.seeds} prompt seeds summed. Tokens "
            f"equal across settings: {'yes' if equal else 'NO'}.\n\n"
            "| read_ahead | hysteresis | stall loads | reads ahead | disk reads in all | "
            "layers run again |\n|---|---|---|---|---|---|\n")
    lines = []
    for ra, hy in settings:
        mine = [r for r in rows if (r["read_ahead"], r["hysteresis"]) == (ra, hy)]
        stalls = sum(r["stall_loads"] for r in mine)
        ahead = sum(r["read_ahead_loads"] for r in mine)
        lines.append(f"| {ra} | {hy} | {stalls} | {ahead} | {stalls + ahead} | "
                     f"{sum(r['resumed_layers'] for r in mine)} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "read_ahead.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (args.out / "read_ahead.md").write_text(head + "\n".join(lines) + "\n")
    print(head + "\n".join(lines))


if __name__ == "__main__":
    main()
