"""The `strata` commands of the lab (strata_runtime/lab): `trace stats`, `trace synth`,
`simulate` (a routing trace through the cache policies and the cost model), `bench` and
`sweep`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from strata_runtime.cli.engine_flags import add_engine_flags, engine_config
from strata_runtime.cli.helptext import Formatter, describe, examples
from strata_runtime.cli.tools import SHAPE_NAMES
from strata_runtime.engine.processes import add_process_flags, is_first

if TYPE_CHECKING:
    from strata_runtime.engine.config import EngineConfig
    from strata_runtime.engine.trace import RoutingTrace
    from strata_runtime.lab.cost_model import HardwareProfile, ModelCost, Prediction
    from strata_runtime.lab.simulate import CacheResult

__all__ = ["add_bench_parser", "add_simulate_parser", "add_sweep_parser", "add_trace_parsers"]


# ------------------------------------------------------------------------------ traces


def _trace_stats(args: argparse.Namespace) -> int:
    # here, not above: CLI start-up
    from strata_runtime.engine.trace import load_trace, trace_stats

    trace = load_trace(args.trace)
    print(f"{args.trace}: {trace.num_layers} layers, {trace.num_experts} experts, "
          f"top-{trace.top_k}, seed {trace.seed}")
    print(trace_stats(trace).render())
    return 0


def _trace_synth(args: argparse.Namespace) -> int:
    # here, not above: CLI start-up
    from strata_runtime.engine.trace import save_trace, synthetic_trace

    trace = synthetic_trace(args.layers, args.experts, args.top_k, args.steps, args.rows,
                            args.skew, args.seed, drift_at=args.drift_at)
    save_trace(args.out, trace)
    print(f"wrote {args.out}: {trace.num_steps} steps of {args.rows} rows")
    return 0


def add_trace_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """`strata trace stats` and `strata trace synth`."""
    tr = sub.add_parser("trace", help="routing traces: statistics, synthetic ones")
    tr_sub = tr.add_subparsers(dest="what", required=True)
    st = tr_sub.add_parser(
        "stats", parents=[common], formatter_class=Formatter,
        help="per-layer popularity and the reuse-distance histogram of a trace",
        epilog=examples("strata trace stats run.trace.npz"))
    st.add_argument("trace", help="routing trace (.npz, strata_runtime/trace.py)")
    st.set_defaults(func=_trace_stats)
    sy = tr_sub.add_parser(
        "synth", parents=[common], formatter_class=Formatter,
        help="write a synthetic decode trace with Zipf-like expert popularity",
        epilog=examples("strata trace synth skew.npz --layers 8 --experts 64 --top-k 4 "
                        "--steps 500 --rows 16 --skew 1.0 --drift-at 250"))
    sy.add_argument("out")
    sy.add_argument("--layers", type=int, required=True)
    sy.add_argument("--experts", type=int, required=True)
    sy.add_argument("--top-k", type=int, required=True)
    sy.add_argument("--steps", type=int, required=True, help="decode steps")
    sy.add_argument("--rows", type=int, default=8, help="live rows per step")
    sy.add_argument("--skew", type=float, default=1.0,
                    help="Zipf exponent of each layer's popularity (0: uniform)")
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--drift-at", type=int, default=None, metavar="STEP",
                    help="from this step on, every layer's popularity is permuted afresh")
    sy.set_defaults(func=_trace_synth)


# ------------------------------------------------------------------------------ simulate


def _model_cost(args: argparse.Namespace, trace: RoutingTrace) -> ModelCost:
    """The bytes and FLOPs of the traced model: the flags, else --shape, else the trace's
    `model_config` metadata (its `bytes_per_expert`, if recorded, over the bf16 size)."""
    # here, not above: CLI start-up
    from strata_jax.formats.config import ModelConfig
    from strata_runtime.lab.cost_model import ModelCost, model_cost

    cfg = None
    if args.shape is not None:
        from strata_jax.tools.synth import SHAPES  # here, not above: CLI start-up

        cfg = SHAPES[args.shape].replace(num_layers=trace.num_layers)
    elif "model_config" in trace.extra:
        cfg = ModelConfig.from_dict(trace.extra["model_config"])
    if cfg is not None and (cfg.num_experts, cfg.top_k) != (trace.num_experts, trace.top_k):
        raise ValueError(f"the model has {cfg.num_experts} experts, top-{cfg.top_k}; the trace "
                         f"{trace.num_experts}, top-{trace.top_k}")
    if cfg is None and args.bytes_per_expert is None:
        raise ValueError("the cost model needs the model's bytes: give --shape NAME, or "
                         "--bytes-per-expert B (and --dense-bytes B)")
    base = model_cost(cfg) if cfg is not None else None
    if base is not None and "bytes_per_expert" in trace.extra:  # as the engine's slots held it
        base = dataclasses.replace(base, bytes_per_expert=int(trace.extra["bytes_per_expert"]))
    bpe = args.bytes_per_expert if args.bytes_per_expert is not None else base.bytes_per_expert
    dense = args.dense_bytes if args.dense_bytes is not None else (
        base.dense_bytes if base is not None else 0)
    flops = args.flops_per_token or (base.flops_per_token if base is not None else float(
        dense + trace.top_k * trace.num_layers * bpe))  # 2 FLOPs per 2-byte parameter
    return ModelCost(bytes_per_expert=bpe, dense_bytes=dense, flops_per_token=flops)


def _slots(args: argparse.Namespace, trace: RoutingTrace) -> tuple[int, int, int]:
    """How many experts are pinned, and the cache and staging slots: the flags, else the
    defaults their help names."""
    total = trace.num_layers * trace.num_experts
    pinned = total // 4 if args.pinned is None else args.pinned
    cache = total // 8 if args.cache is None else args.cache
    staging = args.staging if args.staging is not None else min(
        trace.num_experts, trace.top_k * int(trace.live_rows().max(initial=1)))
    return pinned, cache, staging


def _print_table(args: argparse.Namespace, hw: HardwareProfile, model: ModelCost,
                 trace: RoutingTrace, results: list[CacheResult], opt: CacheResult
                 ) -> Prediction:
    """One row per replayed policy and Belady's; returns the prediction of Belady's cache
    under a perfect prefetcher."""
    from strata_runtime.lab.simulate import predict_replay  # here, not above: CLI start-up

    print("| policy | hits | hit rate | Belady hit rate | perfect-prefetch bound | copies/step "
          "| predicted tok/s | binding | tok/s, perfect prefetch |")
    print("|---|---|---|---|---|---|---|---|---|")
    steps = max(trace.num_steps, 1)
    for r in [*results, opt]:
        now = predict_replay(hw, model, trace, r, hidden=args.hidden, miss=args.miss)
        best = predict_replay(hw, model, trace, r, hidden=r.prefetch_bound, miss=args.miss)
        print(f"| {r.name} | {r.hits} / {r.accesses} | {r.hit_rate:.3f} | {opt.hit_rate:.3f} "
              f"| {r.prefetch_bound:.3f} | {r.copies / steps:.2f} | {now.tok_s:.4g} "
              f"| {now.binding} | {best.tok_s:.4g} |")
    return best


def _simulate(args: argparse.Namespace) -> int:
    # here, not above: CLI start-up
    from strata_runtime.engine.trace import load_trace
    from strata_runtime.lab.cost_model import profile
    from strata_runtime.lab.simulate import compare, pinned_by_heat
    from strata_runtime.residency.cache_policy import POLICIES

    hw = profile(args.hardware)
    trace = load_trace(args.trace)
    model = _model_cost(args, trace)
    pinned_n, cache, staging = _slots(args, trace)
    pinned = pinned_by_heat(trace, pinned_n)
    results, opt = compare(trace, args.policy or POLICIES, pinned=pinned, cache=cache,
                           staging=staging, admission=args.admission,
                           cache_admit=args.cache_admit)
    print(f"{args.trace} on {hw.name}: {len(pinned)} pinned (hottest of the trace), {cache} "
          f"cache slots, {staging} staging slots, {args.admission} admission "
          f"({args.cache_admit}), "
          f"{model.bytes_per_expert / 1e6:.3g} MB per expert, {model.dense_bytes / 1e9:.3g} GB "
          f"dense, {trace.num_steps} steps\n")
    best = _print_table(args, hw, model, trace, results, opt)
    print(f"\nat best (Belady's cache, perfect prefetch): {best.tok_s:.4g} tok/s, bound by "
          f"{best.binding} ({', '.join(f'{k} {1e3 * v:.3g} ms' for k, v in best.terms.items())})")
    if hw.reported:
        print(f"reported on {hw.name}: {hw.reported}")
    print("predicted tok/s: misses prefetched in time " f"{args.hidden:.0%} (--hidden); "
          f"misses --miss {args.miss}; copies include the engine's admissions "
          "(strata_runtime.lab.cost_model)")
    return 0


def add_simulate_parser(sub: argparse._SubParsersAction,
                        common: argparse.ArgumentParser) -> None:
    """`strata simulate`."""
    # here, not above: CLI start-up
    from strata_runtime.lab.cost_model import PROFILES
    from strata_runtime.lab.simulate import ADMISSIONS
    from strata_runtime.residency.cache_policy import ADMITS, POLICIES
    from strata_runtime.residency.ledger import parse_bytes

    sim = sub.add_parser(
        "simulate", parents=[common], formatter_class=Formatter,
        help="replay a trace through the cache policies, Belady and the cost model",
        description=describe(
            "Replay a routing trace through the engine's cache policies (its ExpertCache, fed "
            "as the engine feeds it), Belady's optimum on the same pinned set and cache slots, "
            "and a perfect prefetcher; predict decode tok/s on a hardware profile "
            "(strata_runtime/cost_model.py) and name the binding resource."),
        epilog=examples("strata simulate run.npz --hardware h200-pcie5 --shape mixtral-8x7b",
                        "strata simulate skew.npz --hardware rtx3090-pcie3-xeon-v4 --policy lru "
                        "--pinned 64 --cache 32 --bytes-per-expert 60MB --dense-bytes 2GB"))
    sim.add_argument("trace", help="routing trace (.npz)")
    sim.add_argument("--hardware", required=True, choices=tuple(PROFILES),
                     help="hardware profile of the cost model")
    sim.add_argument("--policy", action="append", choices=POLICIES, default=None,
                     help="cache policy to replay; repeatable (unset: all)")
    sim.add_argument("--pinned", type=int, default=None, metavar="N",
                     help="experts pinned in HBM, the trace's hottest (unset: a quarter)")
    sim.add_argument("--cache", type=int, default=None, metavar="N",
                     help="cache slots the policy manages (unset: an eighth of the experts)")
    sim.add_argument("--staging", type=int, default=None, metavar="N",
                     help="staging slots of the perfect prefetcher (unset: top_k x rows)")
    sim.add_argument("--admission", choices=ADMISSIONS, default="engine",
                     help="engine: a step's experts enter the cache after the next step "
                          "(the engine's lag); demand: at their miss (Belady's model)")
    sim.add_argument("--cache-admit", choices=ADMITS, default="hotter",
                     help="a routed expert takes a full cache's victim's slot always, or only "
                          "if hotter (EngineConfig.cache_admit)")
    sim.add_argument("--miss", choices=("fetch", "host", "auto"), default="fetch",
                     help="the engine's remedy for a miss (EngineConfig.miss): copied, "
                          "computed on the host, or each layer's split by the profile's rates")
    sim.add_argument("--hidden", type=float, default=0.0, metavar="X",
                     help="share of misses prefetched in time, for the predicted tok/s")
    sim.add_argument("--shape", default=None, choices=SHAPE_NAMES,
                     help="the model's bytes and FLOPs from this shape (bf16, the trace's "
                          "layers)")
    sim.add_argument("--bytes-per-expert", type=parse_bytes, default=None, metavar="B",
                     help="bytes of one expert as the slots hold it (e.g. 117MB)")
    sim.add_argument("--dense-bytes", type=parse_bytes, default=None, metavar="B",
                     help="bytes read once per step besides the experts")
    sim.add_argument("--flops-per-token", type=float, default=None, metavar="F",
                     help="matmul FLOPs per token (unset: 2 per 2-byte parameter read)")
    sim.set_defaults(func=_simulate)


# ------------------------------------------------------------------------------ bench, sweep


def _bench_config(args: argparse.Namespace) -> EngineConfig | None:
    """The EngineConfig of the engine flags; without --hbm every expert gets an HBM slot
    (hbm_budget None), unless --resident-experts and the like say otherwise."""
    ns = argparse.Namespace(**vars(args))
    if not hasattr(ns, "hbm_budget"):
        ns.hbm_budget = None
    return engine_config(ns)


def _bench(args: argparse.Namespace) -> int:
    # here, not above: CLI start-up
    from strata_runtime.lab.bench import BenchSettings, render_summary, run_bench, write_rows

    config = _bench_config(args)
    settings = BenchSettings(prompts=args.prompts, prompt_len=args.prompt_len, new=args.new,
                             repeats=args.repeats, warmup_new=args.warmup_new, seed=args.seed,
                             hardware=args.hardware)

    first = is_first()  # process 0 prints what every process measured

    def progress(row: dict) -> None:
        if row["kind"] == "repeat" and first:
            print(f"repeat {row['repeat'] + 1}/{settings.repeats}: {row['tok_s']:.4g} tok/s, "
                  f"decode {row['decode_tok_s'] or 0:.4g} tok/s", file=sys.stderr, flush=True)

    result = run_bench(args.ckpt, config, settings, on_row=progress)
    if not first:
        return 0
    print(render_summary(result.summary))
    if args.json_out is not None:
        write_rows(result.rows, args.json_out)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    # here, not above: CLI start-up
    from strata_runtime.lab.sweep import describe as describe_sweep
    from strata_runtime.lab.sweep import load_sweep, prepare, run_sweep, runnable
    from strata_runtime.lab.sweep_report import finish

    sweep = load_sweep(args.sweep, checkpoint=args.checkpoint)
    if args.dry_run:
        print(describe_sweep(sweep))
        return 0
    if args.prepare_only:
        prepare(sweep, runnable(sweep.rungs), lambda line: print(line, file=sys.stderr))
        return 0
    out = Path(args.out) if args.out is not None else Path(f"sweep-{Path(args.sweep).stem}")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rows = run_sweep(sweep, out, resume=args.resume, overwrite=args.overwrite,
                     only=args.rungs, log=log)
    print(finish(rows, out, f"strata sweep {args.sweep}"))
    print(f"wrote {out / 'sweep.jsonl'}, {out / 'sweep.md'}, {out / 'sweep.png'}",
          file=sys.stderr)
    return 1 if any("error" in r for r in rows) else 0


def add_bench_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """`strata bench`."""
    # here, not above: CLI start-up
    from strata_runtime.lab.bench import BenchSettings
    from strata_runtime.lab.cost_model import PROFILES

    defaults = BenchSettings()
    b = sub.add_parser(
        "bench", parents=[common], formatter_class=Formatter,
        help="repeated, fingerprinted tok/s of the engine, beside its bound and the cost model",
        description=describe(
            "Bench the offload engine on synthetic prompts drawn from --seed: a warm-up run "
            "(compilation) apart, then --repeats timed runs with the counters reset before "
            "each. Prints the median tok/s with a 95% percentile-bootstrap interval, step "
            "p50/p99, hit rates, bytes per tier, the bound from the counted bytes and FLOPs "
            "over ceilings measured at the start, and the cost model's prediction. Without "
            "--hbm every expert gets an HBM slot (runtime/lab/bench.py)."),
        epilog=examples(
            "strata bench CKPT --hbm 8GB --host-mem 32GB --repeats 5 --json-out bench.jsonl",
            "strata bench CKPT --resident-experts 8 --batch-capacity 4 --max-len 64 "
            "--prompts 8 --prompt-len 8 --new 16",
            "strata bench CKPT --hbm 24GB --predictor none --policy static --hardware "
            "rtx3090-pcie3-xeon-v4"))
    b.add_argument("ckpt", help="Strata checkpoint folder")
    b.add_argument("--prompts", type=int, default=defaults.prompts, metavar="N",
                   help="synthetic prompts per timed run (continuous batching over the rows)")
    b.add_argument("--prompt-len", type=int, default=defaults.prompt_len, metavar="L",
                   help="ids per prompt")
    b.add_argument("--new", type=int, default=defaults.new, metavar="N",
                   help="tokens generated per prompt")
    b.add_argument("--repeats", type=int, default=defaults.repeats, metavar="R",
                   help="timed runs after the warm-up")
    b.add_argument("--warmup-new", type=int, default=defaults.warmup_new, metavar="N",
                   help="tokens per prompt of the warm-up run (default: --new; any count "
                        "compiles every program the timed runs call)")
    b.add_argument("--seed", type=int, default=defaults.seed, metavar="S",
                   help="draws the prompts (the same seed gives the same tokens)")
    b.add_argument("--hardware", default=defaults.hardware,
                   choices=("measured", *PROFILES),
                   help="the cost model's profile: this run's measured ceilings, or a shipped "
                        "one")
    b.add_argument("--json-out", default=None, metavar="PATH",
                   help="write JSON lines: one per repeat, then the summary ('-': stdout)")
    add_engine_flags(b)
    add_process_flags(b)
    b.set_defaults(func=_bench)


def add_sweep_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """`strata sweep`."""
    sw = sub.add_parser(
        "sweep", parents=[common], formatter_class=Formatter,
        help="bench a ladder or grid of engine knobs from a TOML file: table and plot",
        description=describe(
            "Run `strata bench` in this process for every [[rung]] (or every point of a "
            "[grid]) of a TOML file, each on a fresh engine; rows are appended to "
            "OUT/sweep.jsonl as they finish, then OUT/sweep.md (printed) and OUT/sweep.png "
            "are written. Every rung is checked before anything runs. The schema: "
            "runtime/lab/sweep.py and docs/design.md, 'Benchmarks and sweeps'."),
        epilog=examples("strata sweep sweeps/tiny_ladder.toml --out /tmp/tiny",
                        "strata sweep sweeps/seed_ladder.toml --dry-run",
                        "strata sweep sweeps/seed_ladder.toml --out benchmarks/results/ladder "
                        "--resume"))
    sw.add_argument("sweep", metavar="SWEEP.toml", help="the sweep file")
    sw.add_argument("--out", default=None, metavar="DIR",
                    help="output folder; unset: ./sweep-<file stem>")
    sw.add_argument("--dry-run", action="store_true",
                    help="print the resolved rungs and run nothing")
    sw.add_argument("--checkpoint", default=None, metavar="CKPT",
                    help="bench this checkpoint instead of [base]'s (a [synth] of [base]'s "
                         "checkpoint writes it here if it is missing)")
    sw.add_argument("--resume", action="store_true",
                    help="keep OUT/sweep.jsonl's rows and run only the rungs without one")
    sw.add_argument("--overwrite", action="store_true",
                    help="start OUT/sweep.jsonl afresh")
    sw.add_argument("--rung", action="append", default=None, metavar="NAME", dest="rungs",
                    help="run only this rung (repeat the flag for several; the file's order "
                         "holds, and the other rungs keep their rows)")
    sw.add_argument("--prepare-only", action="store_true",
                    help="write the [synth] / [quantize] checkpoints the rungs need, then stop")
    sw.set_defaults(func=_sweep)
