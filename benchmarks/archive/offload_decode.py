"""Offloaded decode on the GPU: tok/s under an HBM budget smaller than the model, beside the
bound from the bytes each step moved, the peers measured on the same machine, and the targets.

One row per call (`--ckpt --label --batch`), appended to offload_decode.json under --out;
`--report` renders every row there as offload_decode.md. Run by benchmarks/run_h200_offload.sh.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from benchmarks.common import hbm_bandwidth, machine, pinned_bandwidth
from strata_jax.formats.checkpoint import CheckpointReader
from strata_runtime.engine.offload import Engine
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.plan import plan_for
from strata_runtime.residency.ledger import ModelBytes
from strata_runtime.scheduler import Scheduler

# DESIGN.md, same machine and shape (Mixtral-8x7B, 8 layers): tok/s at B=1 / B=16
PEERS = {
    "bf16": {1: ("accelerate 0.32, ik_llama F16 hybrid 15.3", 0.32 * 30),
             16: ("accelerate 4.8, ik_llama F16 CPU 81", 4.8 * 10)},
    "int4": {1: ("ik_llama Q4_0 hybrid 32.7", 65.0),
             16: ("ik_llama F16 CPU 81", 160.0)},
}


def run_row(args) -> dict:
    reader = CheckpointReader(args.ckpt)
    config = EngineConfig(hbm_budget=args.hbm, batch_capacity=args.batch, max_len=128,
                          predictor=args.predictor, policy=args.policy,
                          rebalance_every=args.rebalance_every, dequant=args.dequant,
                          staging_slots=args.staging,
                          host_dequant_cache=args.host_dequant_cache)
    # the timeline's watcher threads cost a resident engine host time and have nothing to show
    config = dataclasses.replace(config, timeline=not plan_for(reader, config).resident)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, reader.config.vocab_size, (args.batch, 16)).tolist()
    with Engine(reader, config) as engine:
        sched = Scheduler(engine)
        for p in prompts:
            sched.submit(p, args.warmup + args.steps + 2)
        for _ in range(args.warmup):  # prefill, compiles, and rebalancing finds the heat
            sched.step()
        engine.reset_stats()
        for _ in range(args.steps):  # decode only: every row stays busy
            sched.step()
        stats = engine.stats()
        ledger = engine.ledger
    return {"label": args.label, "batch": args.batch, "hbm": args.hbm, "steps": args.steps,
            "predictor": args.predictor, "policy": args.policy, "dequant": args.dequant,
            "staging": engine.staging,
            "bytes_per_expert": ledger.bytes_per_expert, "tier0": ledger.tier0,
            "dense": ModelBytes.from_reader(reader).dense, "stats": stats}


def bound(row: dict, bw: dict) -> dict:
    """Per-step bytes counted by the engine -> the time they need at the bandwidths measured in
    the row's own run (`bw` for rows without one)."""
    bw = row.get("bandwidth") or bw
    s, steps, bpe = row["stats"], row["steps"], row["bytes_per_expert"]
    h2d = sum(s["h2d_bytes"].values()) / steps
    needed = s["tier0_needed_experts"] / steps
    # the kernels read each needed expert once; an install reads the copy and writes a slot
    hbm = row["dense"] + needed * bpe + 2 * s["staged"] / steps * bpe
    t_pcie, t_hbm = h2d / (bw["pinned"] * 1e9), hbm / (bw["hbm_read"] * 1e9)
    t = max(t_pcie, t_hbm)
    return {"h2d_GB": h2d / 1e9, "hbm_GB": hbm / 1e9, "bound_tok_s": row["batch"] / t,
            "dequant": row.get("dequant", "device"),
            "binds": "PCIe" if t_pcie >= t_hbm else "HBM"}


def binding(tok: float, b: dict, stalls: float = 0.0) -> str:
    """The resource that limits a row: the bound's; below 0.8 of it with misses that waited
    for their copies, that copy latency; far below it (< 0.5), the host: its per-layer dispatch
    (or its dequantization with dequant=host)."""
    ratio = tok / b["bound_tok_s"]
    if ratio >= 0.8 or (ratio >= 0.5 and not stalls):
        return b["binds"]
    if ratio >= 0.5:
        return f"{b['binds']} latency ({stalls:.1f} misses/step wait for their copy)"
    return "host dequant" if b.get("dequant") == "host" else "host dispatch"


def _fmt(value: float | None) -> str:
    """Overlap fraction: '-' when no timeline was recorded (resident: nothing to overlap)."""
    return "-" if value is None else f"{value:.2f}"


def render(rows: list[dict], bw: dict, env: dict, runs: dict | None = None) -> str:
    """The table; `runs` names the device runs (commit, what changed) that rows came from."""
    lines = [
        f"# Offloaded decode, synthetic Mixtral-8x7B shape, 8 layers ({env['device']}, "
        f"JAX {env['jax']}, {env['date']})",
        "",
        f"Measured: pinned host->device {bw['pinned']:.1f} GB/s (expert-sized copies), HBM read "
        f"{bw['hbm_read']:.0f} GB/s. Bound = B / max(H2D bytes / pinned BW, HBM bytes / HBM BW) "
        "from the bytes the engine counted per step, at the bandwidths measured in the row's run.",
        "",
        *[f"- run {k}: {v}" for k, v in (runs or {}).items()],
        "",
        "| run | experts | routing | B | predictor | policy | dequant | staging | tok/s | target |"
        " peers (tok/s) | bound tok/s | achieved/bound | binds | H2D GB/step | wasted |"
        " tier-0 hit | overlap | stalls/step | p50 ms | p99 ms |",
        "|" + "---|" * 21,
    ]
    for row in rows:
        s, b = row["stats"], bound(row, bw)
        quant, routing = row["label"].split("-", 1)
        peers, target = PEERS[quant][row["batch"]]
        tok = s["decode_tok_s"]
        moved = sum(s["h2d_bytes"].values())
        wasted = s["wasted_bytes"] / moved if moved else 0.0
        stalls = s["stalls"] / row["steps"]
        verdict = "met" if tok >= target else f"missed ({binding(tok, b, stalls)} binds)"
        lines.append(
            f"| {row.get('run', '')} | {quant} | {routing} | {row['batch']} | "
            f"{row['predictor']} | {row['policy']} | "
            f"{row.get('dequant', 'device')} | {row.get('staging', '-')} | {tok:.1f} | "
            f"≥{target:g} {verdict} | "
            f"{peers} | {b['bound_tok_s']:.1f} | {tok / b['bound_tok_s']:.2f} | "
            f"{binding(tok, b, stalls)} | "
            f"{b['h2d_GB']:.2f} | {wasted:.0%} | {s['tier0_hit_rate']:.2f} | "
            f"{_fmt(s['overlap_fraction'])} | {s['stalls'] / row['steps']:.1f} | "
            f"{s['step_ms_p50']:.1f} | {s['step_ms_p99']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], bw: dict, path: Path) -> bool:
    """Bar chart of tok/s beside the bound and the target, per row (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    labels = [f"{r['label']}\nB={r['batch']} {r['predictor']}"
              + ("" if r.get("dequant", "device") == "device" else "\nhost dequant")
              for r in rows]
    got = [r["stats"]["decode_tok_s"] for r in rows]
    bounds = [bound(r, bw)["bound_tok_s"] for r in rows]
    targets = [PEERS[r["label"].split("-")[0]][r["batch"]][1] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.5))
    ax.bar(x - 0.2, got, 0.4, label="measured tok/s")
    ax.bar(x + 0.2, bounds, 0.4, label="bound (counted bytes)", alpha=0.5)
    ax.scatter(x, targets, marker="_", s=600, color="red", label="target", zorder=3)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("decode tok/s")
    ax.legend(fontsize=8)
    ax.set_title("offloaded decode, 8 GiB HBM")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt")
    ap.add_argument("--label", help="<bf16|int4>-<uniform|skew>")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hbm", default="8GiB")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument("--predictor", default="next-gate")
    ap.add_argument("--policy", default="lfru")
    ap.add_argument("--dequant", default="device", choices=("device", "host"))
    ap.add_argument("--rebalance-every", type=int, default=4)
    ap.add_argument("--staging", type=int, default=None,
                    help="experts per staging buffer (default: what one layer can need)")
    ap.add_argument("--host-dequant-cache", default=0,
                    help="with --dequant host: bytes of dequantized experts kept pinned")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--measure", action="store_true",
                    help="measure pinned and HBM bandwidth on this machine into --out")
    ap.add_argument("--report", action="store_true", help="render the rows in --out")
    ap.add_argument("--expert-bytes", type=int, nargs="*", default=[117440512] * 3,
                    help="array sizes of one expert, for the pinned bandwidth measurement")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "offload_decode.json"
    doc = json.loads(results.read_text()) if results.exists() else {"rows": []}
    if args.measure:
        doc["bandwidth"] = {"pinned": pinned_bandwidth(args.expert_bytes),
                            "hbm_read": hbm_bandwidth()["read"]}
        doc["machine"] = machine()
        print(doc["bandwidth"])
    elif args.report:
        (out / "offload_decode.md").write_text(render(doc["rows"], doc["bandwidth"],
                                                      doc["machine"], doc.get("runs")))
        plot(doc["rows"], doc["bandwidth"], out / "offload_decode.png")
        print((out / "offload_decode.md").read_text())
    else:
        row = run_row(args)
        row["bandwidth"] = doc.get("bandwidth")
        doc["rows"].append(row)
        print(json.dumps({k: v for k, v in row["stats"].items() if k != "prediction"}))
    results.write_text(json.dumps(doc, indent=1, default=str))


if __name__ == "__main__":
    main()
