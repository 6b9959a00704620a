"""The disk-tier row: a synthetic checkpoint on disk, a host budget that holds only part of its
experts, decoded through the engine, so tier 2 (TensorStore on disk) is read during decode.

docs/design.md, "Disk stalls". The checkpoint is written by `strata synth` (reused when it
exists); the page cache of its expert files is dropped (`posix_fadvise DONTNEED`) before the
timed run, so the disk loads read the device. Reported: tok/s with warm-up apart, disk loads,
disk bytes, disk stall time, the tier hit rates, and the bound from the same run's counted
bytes: per step, disk bytes / the measured cold read rate of one expert through the reader +
host->device bytes / the measured link rate. `--check` also decodes the same prompts with
every expert in tier 1 and compares the tokens bit for bit.

    python -m benchmarks.disk_tier --shape mixtral-8x7b --layers 8 --hbm 8GiB --out OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import jax
import numpy as np

from strata_jax.batching.packing import Admission
from strata_jax.formats.checkpoint import CheckpointReader
from strata_jax.tools import synth
from strata_runtime.engine.config import EngineConfig
from strata_runtime.engine.offload import Engine
from strata_runtime.lab.bench import disk_read_gbps, drop_page_cache
from strata_runtime.residency.link import link_rate


def expert_bytes(reader: CheckpointReader) -> int:
    """Bytes of every expert of the checkpoint as stored."""
    cfg = reader.config
    one = sum(reader.read_expert(0, 0, n).nbytes for n in reader.expert_specs)
    return one * cfg.num_layers * cfg.num_experts


def prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(batch)]


def decode(ckpt: Path, config: EngineConfig, batch_prompts: list[list[int]], new: int,
           before_timed=None) -> tuple[list[list[int]], dict]:
    """Warm up (compile) on a short run, prefill every prompt into its row, then decode `new`
    tokens with the counters reset after the prefill: the figures are decode's alone."""
    with Engine.from_checkpoint(ckpt, config) as engine:
        engine.generate(batch_prompts, 2)
        first = [d.token for d in engine.prefill([Admission(row, p)
                                                  for row, p in enumerate(batch_prompts)])]
        engine.reset_stats()
        if before_timed is not None:
            before_timed()
        t0 = time.perf_counter()
        results = [engine.step() for _ in range(new - 1)]
        steps = [engine.read(r)[: len(batch_prompts)] for r in results]
        stats = engine.stats()
        stats["wall_s"] = time.perf_counter() - t0
        stats["host_slots"] = len(engine.residency.host_key)
    tokens = np.stack([np.array(first), *steps], axis=1).tolist()
    return tokens, stats


def binds(r: dict, disk_bytes_bind: bool) -> str:
    """What the counted bytes say binds, unless disk stalls took over half of the decode's
    seconds: a stall waits on one expert's read, at a rate no throughput figure gives, so the
    time says more than the bytes."""
    decode_s = r["decode_steps"] * r["batch"] / r["tok_s"]
    if r["disk_stall_s"] > 0.5 * decode_s:
        return f"disk stalls ({r['disk_stall_s']:.1f} of {decode_s:.1f} s)"
    return "disk" if disk_bytes_bind else "PCIe"


def row(args: argparse.Namespace, ckpt: Path, batch: int, rates: dict) -> dict:
    reader = CheckpointReader(ckpt)
    total = expert_bytes(reader)
    host = int(args.host_fraction * total)
    config = EngineConfig(hbm_budget=args.hbm, host_budget=host, batch_capacity=batch,
                          max_len=args.prompt_len + args.new + 8, policy=args.policy)
    ps = prompts(reader.config.vocab_size, batch, args.prompt_len, args.seed)
    tokens, stats = decode(ckpt, config, ps, args.new,
                           before_timed=lambda: drop_page_cache(ckpt / "experts"))
    steps = max(stats["decode_steps"], 1)
    disk_step = stats["disk_bytes"] / steps
    h2d_step = stats["h2d_bytes"] / steps
    t_bound = disk_step / (rates["disk_gbps"] * 1e9) + h2d_step / (rates["link_gbps"] * 1e9)
    out = {"batch": batch, "hbm": args.hbm, "host_bytes": host, "expert_bytes": total,
           "tok_s": stats["decode_tok_s"], "bound_tok_s": batch / t_bound if t_bound else None,
           "disk_GB_per_step": disk_step / 1e9, "h2d_GB_per_step": h2d_step / 1e9,
           **rates, **{k: stats[k] for k in (
               "decode_steps", "step_ms_p50", "step_ms_p99", "disk_loads", "disk_bytes",
               "disk_stall_s", "tier0_hit_rate", "prefetch_hit_rate", "misses_per_step",
               "link_busy", "host_slots", "prefill_tok_s")}}
    out["ratio"] = out["tok_s"] / out["bound_tok_s"] if out["bound_tok_s"] else None
    out["binds"] = binds(out, disk_step / rates["disk_gbps"] > h2d_step / rates["link_gbps"])
    if args.check:  # every expert in tier 1: no disk read at all
        ref, _ = decode(ckpt, EngineConfig(hbm_budget=args.hbm, batch_capacity=batch,
                                           max_len=config.max_len, policy=args.policy),
                        ps, args.new)
        out["bit_identical_to_full_host_tier"] = ref == tokens
    return out


def render(rows: list[dict], meta: dict) -> str:
    lines = [f"# Disk tier ({meta['date']}, {meta['device']}, jax {meta['jax']}, "
             f"commit {meta['commit']})", "",
             f"Checkpoint: synthetic {meta['shape']}, {meta['layers']} layers, skew "
             f"{meta['skew']}, written in {meta['synth_s']:.0f} s; HBM budget {meta['hbm']}, "
             f"host budget {meta['host_fraction']:.0%} of the expert bytes. Bound = B / (disk "
             "bytes per step / cold read rate + host->device bytes per step / link rate), "
             "from the bytes counted in the same run.", "",
             "| B | tok/s | bound | ratio | binds | disk loads | disk GB/step | disk stall s | "
             "h2d GB/step | tier-0 hit | prefetch hit | host slots | p50 / p99 ms | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['tok_s']:.2f} | {r['bound_tok_s']:.2f} | {r['ratio']:.2f} | "
            f"{r['binds']} | {r['disk_loads']} | {r['disk_GB_per_step']:.3f} | "
            f"{r['disk_stall_s']:.1f} | {r['h2d_GB_per_step']:.3f} | "
            f"{r['tier0_hit_rate']:.2f} | {r['prefetch_hit_rate']:.2f} | {r['host_slots']} | "
            f"{r['step_ms_p50']:.0f} / {r['step_ms_p99']:.0f} | "
            f"{r.get('bit_identical_to_full_host_tier', '-')} |")
    lines.append("")
    lines.append(f"Cold read {rows[0]['disk_gbps']:.2f} GB/s, link {rows[0]['link_gbps']:.1f} "
                 "GB/s (measured in this run).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="mixtral-8x7b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--skew", type=float, default=0.7)
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/strata_disk_tier_ckpt"))
    ap.add_argument("--hbm", default="8GiB")
    ap.add_argument("--host-fraction", type=float, default=0.5)
    ap.add_argument("--policy", default="lfru")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not (args.ckpt / "config.json").exists():
        synth.synthesize(args.shape, args.ckpt, layers=args.layers, skew=args.skew,
                         progress=False)
    synth_s = time.perf_counter() - t0
    print(f"checkpoint ready in {synth_s:.0f} s", flush=True)
    reader = CheckpointReader(args.ckpt)
    cfg = reader.config
    rates = {"disk_gbps": disk_read_gbps(reader, EngineConfig().fetch_threads),
             "link_gbps": link_rate(jax.devices()[0])}
    print(f"rates {rates}", flush=True)
    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "commit": os.popen("git rev-parse --short HEAD").read().strip(),
            "shape": args.shape, "layers": cfg.num_layers, "skew": args.skew, "synth_s": synth_s,
            "hbm": args.hbm, "host_fraction": args.host_fraction}
    rows = []
    for batch in map(int, args.batch.split(",")):
        r = row(args, args.ckpt, batch, rates)
        print(json.dumps(r), flush=True)
        rows.append(r)
        with open(args.out / "disk_tier.jsonl", "a") as f:
            f.write(json.dumps({**meta, **r}) + "\n")
    (args.out / "disk_tier.md").write_text(render(rows, meta))
    print(render(rows, meta))


if __name__ == "__main__":
    main()
