"""Resident decode throughput on a synthetic Mixtral-8x7B shape (8 layers, bf16), GPU.

Writes the model with `strata synth` (timing the write), loads it with `strata_jax.load`, then
times greedy decode at B=1 and B=16 and compares with the bound: weight bytes read per step
divided by the measured HBM read bandwidth. Prints a table; writes JSON + markdown to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

import strata_jax
from benchmarks.common import hbm_bandwidth, machine
from strata_jax import api
from strata_jax.model import decoder as mdl

PEERS = {  # measured on the same H200 machine and shape (DESIGN.md)
    1: "HF eager 18.4 tok/s; ik_llama.cpp F16 resident 240.6 tok/s",
    16: "HF eager 150 tok/s",
}


def synth_model(dst: Path, shape: str, layers: int) -> dict[str, float]:
    if dst.exists():
        shutil.rmtree(dst)
    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "strata_runtime.cli.main",
            "synth",
            "--shape",
            shape,
            "--layers",
            str(layers),
            "--dtype",
            "bfloat16",
            str(dst),
        ],
        check=True,
    )
    dt = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    return {"bytes": size, "seconds": dt, "GBps": size / dt / 1e9}


def step_bytes(model: api.Model, unique_per_layer: np.ndarray) -> float:
    """Weight bytes one decode step reads: every dense layer, lm_head, the active experts."""
    p = model.params
    dense = sum(a.nbytes for lp in p["layers"] for a in lp.values())
    head = (p["embed"] if model.config.tie_word_embeddings else p["lm_head"]).nbytes
    per_expert = sum(w[0].nbytes for w in model.experts if w is not None)
    return dense + head + float(unique_per_layer.sum()) * per_expert


def unique_experts(model: api.Model, prompts: list[list[int]], new: list[list[int]]) -> np.ndarray:
    """Mean number of distinct experts per layer over the decode steps (from the routing)."""
    seqs = np.array([p + n for p, n in zip(prompts, new, strict=True)], np.int32)
    cfg = model.config
    _, routes = jax.jit(mdl.forward_with_routing, static_argnums=0)(
        cfg, model.params, model.experts, model.slot_table, seqs
    )
    routes = np.asarray(routes).reshape(cfg.num_layers, seqs.shape[0], seqs.shape[1], -1)
    start = len(prompts[0]) - 1
    steps = range(start, seqs.shape[1] - 1)
    return np.array(
        [
            np.mean([len(np.unique(routes[layer, :, t])) for t in steps])
            for layer in range(cfg.num_layers)
        ]
    )


def time_decode(model: api.Model, batch: int, steps: int, prompt_len: int = 16):
    cfg = model.config
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).tolist()
    lengths = np.full((batch,), prompt_len, np.int32)
    tokens = np.array(prompts, np.int32)
    args = (cfg, model.params, model.experts, model.slot_table)
    max_len = api.bucket(prompt_len + steps + 1, minimum=64)

    def run():
        first, cache = api._prefill_first(*args, tokens, lengths, max_len)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        out = api._greedy_decode(*args, cache, first, lengths, steps)
        out.block_until_ready()
        return time.perf_counter() - t0, out

    run()
    times, out = [], None
    for _ in range(5):
        dt, out = run()
        times.append(dt)
    per_step = float(np.median(times)) / steps
    new = np.asarray(out)[:, 1:].tolist()
    return per_step, prompts, [n[:-1] for n in new]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ckpt", type=Path, default=Path("/tmp/strata_mixtral8"))
    parser.add_argument("--shape", default="mixtral-8x7b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    result = machine()
    result["hbm_GBps"] = bw = hbm_bandwidth()
    result["shape"], result["layers"] = args.shape, args.layers
    result["synth"] = synth_model(args.ckpt, args.shape, args.layers)
    t0 = time.perf_counter()
    model = strata_jax.load(args.ckpt)
    jax.block_until_ready(model.experts)
    result["load_seconds"] = time.perf_counter() - t0
    rows = []
    for batch in (1, 16):
        per_step, prompts, new = time_decode(model, batch, args.steps)
        uniq = unique_experts(model, prompts, new)
        nbytes = step_bytes(model, uniq)
        bound = nbytes / (bw["read"] * 1e9)
        rows.append({
            "batch": batch, "step_ms": per_step * 1e3, "tok_s": batch / per_step,
            "experts_per_layer": float(uniq.mean()), "bytes_per_step_GB": nbytes / 1e9,
            "bound_ms": bound * 1e3, "bound_tok_s": batch / bound,
            "achieved_over_bound": bound / per_step,
            "peers": PEERS[batch],
        })  # fmt: skip
    result["rows"] = rows
    table = render(result)
    print(table)
    (args.out / "resident_decode.json").write_text(json.dumps(result, indent=2))
    (args.out / "resident_decode.md").write_text(table)


def render(r: dict) -> str:
    s = r["synth"]
    lines = [
        f"# Resident decode, synthetic {r['shape']} shape, {r['layers']} layers, bf16",
        f"{r['device']}, JAX {r['jax']}, {r['date']}",
        f"HBM bandwidth: read {r['hbm_GBps']['read']:.0f} GB/s, "
        f"copy {r['hbm_GBps']['copy']:.0f} GB/s (bound uses read)",
        f"synth write: {s['bytes'] / 1e9:.1f} GB in {s['seconds']:.1f} s = {s['GBps']:.2f} GB/s "
        f"(incl. process start); load + verify: {r['load_seconds']:.1f} s",
        "",
        "| B | tok/s | ms/step | experts/layer | GB read/step | bound tok/s | achieved/bound "
        "| peers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['batch']} | {row['tok_s']:.0f} | {row['step_ms']:.3f} | "
            f"{row['experts_per_layer']:.2f} | {row['bytes_per_step_GB']:.2f} | "
            f"{row['bound_tok_s']:.0f} | {row['achieved_over_bound']:.2f} | {row['peers']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
