"""Routing drift: tok/s and the tier-0 hit rate over time, with and without rebalancing, when
the experts' popularity shifts mid-run.

The workload is windows of fresh random prompts on a skewed synthetic checkpoint. At window
`--shift-at` every layer's router bias is permuted (the same permutation in both engines): the
hot experts become others, as when a served workload changes domain. Both engines start from the
placement of the heat recorded on the same workload before the shift (`--heat`); one re-ranks
its pinned set by heat every `--rebalance-every` decode steps, the other keeps it.
Writes drift.jsonl (one row per window and engine), drift.md and drift.png under --out.

    python -m benchmarks.drift --out /tmp/drift            # tiny model, CPU, ~1 min
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.tools.synth import synthesize
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine


def shift_popularity(engine: Engine, seed: int) -> None:
    """Permute every layer's router bias (one permutation per layer, from `seed`)."""
    rng = np.random.default_rng(seed)
    layers = engine.params["params"]["layers"]
    bias = np.asarray(layers["router_bias"])
    layers["router_bias"] = jnp.asarray(np.stack([b[rng.permutation(b.size)] for b in bias]),
                                        bias.dtype)


def window(engine: Engine, seed: int, batches: int, prompt_len: int, new: int) -> dict:
    """One window of `batches` batches of fresh prompts: decode tok/s and tier-0 hit rate."""
    rng = np.random.default_rng(seed)
    engine.reset_stats()
    for _ in range(batches):
        prompts = rng.integers(3, engine.cfg.vocab_size, (engine.capacity, prompt_len))
        engine.generate(prompts.tolist(), new)
    stats = engine.stats()
    return {"tok_s": stats["decode_tok_s"], "hit_rate": stats["tier0_hit_rate"],
            "swaps": stats["rebalance_swaps"], "h2d_bytes": stats["h2d_bytes"]}


def run(args: argparse.Namespace) -> list[dict]:
    base = EngineConfig(resident_experts=args.resident, host_experts=None,
                        batch_capacity=args.batch, max_len=args.prompt_len + args.new + 8,
                        policy="static", predictor="none", hysteresis=0.05, heat_decay=0.8)
    heat = args.out / "heat.json"  # both start from the placement the workload's heat gives
    with Engine.from_checkpoint(args.ckpt, base) as engine:
        for w in range(args.shift_at):
            window(engine, 1000 + w, args.batches, args.prompt_len, args.new)
        engine.save_heat(heat)
    base = dataclasses.replace(base, heat_file=str(heat))
    engines = {"rebalance": dataclasses.replace(base, rebalance_every=args.rebalance_every),
               "static": base}
    rows = []
    for name, config in engines.items():
        with Engine.from_checkpoint(args.ckpt, config) as engine:
            window(engine, 0, 1, args.prompt_len, args.new)  # compile
            for w in range(args.windows):
                if w == args.shift_at:
                    shift_popularity(engine, args.seed + 7)
                r = {"engine": name, "window": w, **window(
                    engine, args.seed + w, args.batches, args.prompt_len, args.new)}
                rows.append(r)
                print(json.dumps(r), flush=True)
    return rows


def plot(rows: list[dict], shift_at: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_tok) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name in ("rebalance", "static"):
        mine = [r for r in rows if r["engine"] == name]
        x = [r["window"] for r in mine]
        ax_hit.plot(x, [r["hit_rate"] for r in mine], marker="o", label=name)
        ax_tok.plot(x, [r["tok_s"] for r in mine], marker="o", label=name)
    for ax in (ax_hit, ax_tok):
        ax.axvline(shift_at - 0.5, color="gray", linestyle="--", label="popularity shift")
    ax_hit.set_ylabel("tier-0 hit rate")
    ax_tok.set_ylabel("decode tok/s")
    ax_tok.set_xlabel("window")
    ax_hit.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(rows: list[dict], meta: dict) -> str:
    lines = [f"# Routing drift ({meta['date']}, {meta['device']}, jax {meta['jax']})", "",
             f"Checkpoint {meta['ckpt']}; {meta['resident']} experts pinned in HBM, B = "
             f"{meta['batch']}; popularity shifted before window {meta['shift_at']}; "
             f"rebalancing every {meta['rebalance_every']} decode steps.", "",
             "| window | rebalance hit | rebalance tok/s | swaps | static hit | static tok/s |",
             "|---|---|---|---|---|---|"]
    by = {(r["engine"], r["window"]): r for r in rows}
    for w in sorted({r["window"] for r in rows}):
        a, b = by[("rebalance", w)], by[("static", w)]
        lines.append(f"| {w} | {a['hit_rate']:.3f} | {a['tok_s']:.0f} | {a['swaps']} | "
                     f"{b['hit_rate']:.3f} | {b['tok_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, default=None,
                    help="a skewed checkpoint (default: a tiny one, skew 0.85, written here)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resident", type=int, default=8, help="experts pinned in HBM")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=6)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--batches", type=int, default=3, help="batches per window")
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--shift-at", type=int, default=4)
    ap.add_argument("--rebalance-every", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ckpt is None:
        args.ckpt = args.out / "tiny_skewed"
        if not (args.ckpt / "config.json").exists():
            synthesize("tiny", args.ckpt, skew=0.85, seed=3, dtype="float32", progress=False)
    t0 = time.perf_counter()
    rows = run(args)
    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "ckpt": str(args.ckpt), "resident": args.resident,
            "batch": args.batch, "shift_at": args.shift_at,
            "rebalance_every": args.rebalance_every, "seconds": time.perf_counter() - t0}
    with open(args.out / "drift.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**meta, **r}) + "\n")
    (args.out / "drift.md").write_text(render(rows, meta))
    plot(rows, args.shift_at, args.out / "drift.png")
    print(render(rows, meta))


if __name__ == "__main__":
    main()
