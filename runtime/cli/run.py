"""The `strata` commands that run a model: `generate` (resident, or through the offload engine
with --hbm), `plan` (the HBM budget's split, before a run) and `eval lm` (lm-eval's runner)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import strata_jax
from strata_jax.batching.text import cut_at_stop
from strata_jax.step.sampling import SamplingParams
from strata_runtime.cli.engine_flags import (
    add_engine_flags,
    engine_config,
    field_docs,
    resident_config,
)
from strata_runtime.cli.helptext import Formatter, describe, examples
from strata_runtime.cli.tools import SHAPE_NAMES
from strata_runtime.engine.processes import add_process_flags, is_first, own_path

if TYPE_CHECKING:
    from strata_jax.formats.config import ModelConfig
    from strata_jax.formats.tokenizer import Tokenizer
    from strata_runtime.engine.config import EngineConfig
    from strata_runtime.engine.offload import Engine
    from strata_runtime.residency.ledger import Ledger

__all__ = ["Run", "add_eval_lm_parser", "add_generate_parser", "add_plan_parser", "eval_lm",
           "ordinal"]

Prompt = str | list[int]
"""One --prompt (text) or --prompt-ids (ids) as given."""


# ------------------------------------------------------------------------------ generate


def _ids(value: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]."""
    try:
        ids = [int(t) for t in value.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected comma-separated integer token ids, e.g. 1,2,3") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def _sampling(args: argparse.Namespace, eos_ids: frozenset[int]) -> SamplingParams:
    stop_ids = set(args.stop_id) | (set() if args.ignore_eos else set(eos_ids))
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed,
        stop_ids=frozenset(stop_ids), stop=tuple(args.stop))


def _needs_hbm(args: argparse.Namespace) -> None:
    for flag, value in (("--record-heat", args.record_heat),
                        ("--export-timeline", args.export_timeline)):
        if value is not None:
            raise ValueError(f"{flag} only applies to the offload engine: add --hbm SIZE, or "
                             "drop it")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """What a generate call produced and how long it took."""

    tokens: list[list[int]]
    """New tokens per request."""
    load_s: float
    """Reading the checkpoint (and building the engine)."""
    warmup_s: float | None
    """The warm-up run (compilation; a cache hit loads instead); None with --no-warmup."""
    run_s: float
    """The timed run: prefill and decode of every request."""
    stats: dict[str, object] | None
    """The engine's statistics of the timed run (offload engine only)."""


def _run_resident(args: argparse.Namespace, prompts: list[list[int]],
                  sampling: SamplingParams) -> Run:
    shape = resident_config(args)
    t0 = time.perf_counter()
    model = strata_jax.load(args.ckpt, expert_devices=shape.expert_devices)
    load_s = time.perf_counter() - t0

    def run(n: int) -> list[list[int]]:
        return strata_jax.generate(model, prompts, n, sampling=sampling,
                                   batch_capacity=shape.batch_capacity,
                                   max_len=shape.max_len, prefill_chunk=shape.prefill_chunk,
                                   prefill_rows=shape.prefill_rows)

    return _timed(args, run, load_s, None)


def _run_engine(args: argparse.Namespace, config: EngineConfig, prompts: list[list[int]],
                sampling: SamplingParams, tok: Tokenizer | None) -> Run:
    from strata_runtime.engine.offload import Engine  # here, not above: CLI start-up

    if args.export_timeline is not None:
        config = dataclasses.replace(config, timeline=True)
    t0 = time.perf_counter()
    with Engine.from_checkpoint(args.ckpt, config) as engine:
        load_s = time.perf_counter() - t0

        def run(n: int) -> list[list[int]]:
            return engine.generate(prompts, n, sampling, tok)

        result = _timed(args, run, load_s, engine)
        if args.record_heat and is_first():  # the same heat on every process
            engine.save_heat(args.record_heat)
        if args.export_timeline:
            engine.export_timeline(own_path(args.export_timeline))
    return result


def _timed(args: argparse.Namespace, run: Callable[[int], list[list[int]]], load_s: float,
           engine: Engine | None) -> Run:
    warmup_s = None
    if not args.no_warmup:
        t0 = time.perf_counter()
        run(min(2, args.max_new_tokens))  # compiles prefill and decode for these shapes
        warmup_s = time.perf_counter() - t0
        if engine is not None:
            engine.reset_stats()
    t0 = time.perf_counter()
    tokens = run(args.max_new_tokens)
    run_s = time.perf_counter() - t0
    stats = engine.stats() if engine is not None else None
    return Run(tokens=tokens, load_s=load_s, warmup_s=warmup_s, run_s=run_s, stats=stats)


def _requests(prompts: list[list[int]], out: list[list[int]], tok: Tokenizer | None,
              args: argparse.Namespace, sampling: SamplingParams) -> list[dict[str, object]]:
    reqs = []
    for prompt, new in zip(prompts, out, strict=True):
        req: dict[str, object] = {"prompt_ids": prompt, "new_ids": new}
        stopped = bool(new) and new[-1] in sampling.stop_ids
        if tok is not None:
            full = tok.decode(new)  # ends with the token that completed a stop string
            req["text"] = cut_at_stop(full, args.stop)
            stopped = stopped or any(s in full for s in args.stop)
        req["finish"] = "stop" if stopped else "length"
        reqs.append(req)
    return reqs


def _print_requests(reqs: list[dict[str, object]], given: list[Prompt]) -> None:
    for i, (req, prompt) in enumerate(zip(reqs, given, strict=True)):
        if len(reqs) > 1:
            print(f"--- request {i}: {len(req['prompt_ids'])} prompt tokens, "
                  f"{len(req['new_ids'])} new ({req['finish']})")
        if not isinstance(prompt, str) or "text" not in req:
            print(f"{req['prompt_ids']} -> {req['new_ids']}")
        if "text" in req:
            print(req["text"])


def _timing(run: Run, reqs: list[dict[str, object]]) -> dict[str, object]:
    new = sum(len(r) for r in run.tokens)
    return {"load_s": run.load_s, "warmup_s": run.warmup_s, "run_s": run.run_s,
            "prompt_tokens": sum(len(r["prompt_ids"]) for r in reqs), "new_tokens": new,
            "tok_s": new / run.run_s if run.run_s > 0 else None,
            "includes_compilation": run.warmup_s is None}


def _report(timing: dict[str, object], stats: dict[str, object] | None) -> str:
    from strata_runtime.engine.stats import render  # here, not above: CLI start-up

    lines = ["timing:", render(timing)]
    if stats is not None:
        lines += ["engine stats (the timed run):", render(stats)]
    return "\n".join(lines)


def _write_json(doc: dict[str, object], where: str) -> None:
    text = json.dumps(doc, indent=2, default=float) + "\n"
    if where == "-":
        sys.stdout.write(text)
    else:
        Path(where).write_text(text)


def _check_requests(args: argparse.Namespace, given: list[Prompt], prompts: list[list[int]],
                    max_len: int) -> None:
    """Every request checked as every path checks it (`checks.check_request`) before anything
    loads, the error naming the flags that set the values at fault."""
    # here, not above: CLI start-up
    from strata_jax.batching.checks import check_request
    from strata_jax.formats.checkpoint import CheckpointReader

    cfg = CheckpointReader(args.ckpt).config
    for i, (text, ids) in enumerate(zip(given, prompts, strict=True)):
        flag = "--prompt" if isinstance(text, str) else "--prompt-ids"
        try:
            check_request(cfg, i, ids, args.max_new_tokens, max_len)
        except ValueError as e:
            raise ValueError(f"{e} (the {ordinal(i + 1)} prompt flag, {flag}; "
                             f"--max-new-tokens {args.max_new_tokens}, --max-len {max_len})"
                             ) from None


def ordinal(n: int) -> str:
    """1 -> '1st', 2 -> '2nd', 11 -> '11th'."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _prompts(args: argparse.Namespace, config: EngineConfig | None
             ) -> tuple[list[Prompt], list[list[int]], Tokenizer | None]:
    """The prompts as given, as ids, and the tokenizer (None where nothing needs one), every
    request checked before anything loads."""
    # here, not above: CLI start-up
    from strata_jax.formats.tokenizer import encode_prompts, load_tokenizer

    if config is None:
        _needs_hbm(args)
    given = args.prompts or []
    if not given:
        raise ValueError("give a prompt: --prompt TEXT or --prompt-ids 1,2,3 (repeat for a "
                         "batch)")
    if "" in args.stop:
        raise ValueError("--stop: a stop string must not be empty")
    texts = any(isinstance(p, str) for p in given) or args.chat or args.stop
    has_tok = (Path(args.ckpt) / "tokenizer.json").is_file()
    tok = load_tokenizer(args.ckpt) if texts or has_tok else None
    prompts = encode_prompts(tok, given, chat=args.chat)
    _check_requests(args, given, prompts, (config or resident_config(args)).max_len)
    return given, prompts, tok


def _generate(args: argparse.Namespace) -> int:
    config = engine_config(args)
    given, prompts, tok = _prompts(args, config)
    sampling = _sampling(args, tok.eos_ids if tok is not None else frozenset())
    if config is None:
        run = _run_resident(args, prompts, sampling)
    else:
        run = _run_engine(args, config, prompts, sampling, tok)
    reqs = _requests(prompts, run.tokens, tok, args, sampling)
    timing = _timing(run, reqs)
    if not is_first():  # process 0 prints what every process computed
        return 0
    if args.json != "-":
        _print_requests(reqs, given)
    print(_report(timing, run.stats), file=sys.stderr)
    if args.json is not None:
        _write_json({"checkpoint": args.ckpt, "requests": reqs, "timing": timing,
                     "engine": run.stats, "sampling": _sampling_doc(sampling)}, args.json)
    return 0


def _sampling_doc(sampling: SamplingParams) -> dict[str, object]:
    doc = dataclasses.asdict(sampling)
    doc["stop_ids"] = sorted(doc["stop_ids"])
    return doc


def _add_sampling_flags(gen: argparse.ArgumentParser) -> None:
    group = gen.add_argument_group("sampling", "how each request picks its tokens "
                                               "(strata_jax.step.sampling.SamplingParams)")
    defaults = SamplingParams()
    docs = field_docs(SamplingParams)
    for name, kind in (("temperature", float), ("top_k", int), ("top_p", float),
                       ("min_p", float), ("repetition_penalty", float), ("seed", int)):
        group.add_argument("--" + name.replace("_", "-"), type=kind,
                           metavar="N" if kind is int else "X", default=getattr(defaults, name),
                           help=docs.get(name, "").replace("%", "%%"))
    group.add_argument("--stop", action="append", default=[], metavar="STR",
                       help="end a request at this text (cut before it); repeatable")
    group.add_argument("--stop-id", action="append", default=[], type=int, metavar="N",
                       help="end a request at this token id (kept); repeatable")
    group.add_argument("--ignore-eos", action="store_true",
                       help="do not stop at the tokenizer's end-of-sequence ids")


def add_generate_parser(sub: argparse._SubParsersAction,
                        common: argparse.ArgumentParser) -> None:
    """`strata generate`."""
    gen = sub.add_parser(
        "generate", parents=[common], formatter_class=Formatter,
        help="generate text or ids (resident, or offloaded with --hbm)",
        description=describe(
            "Generate from prompts: resident by default, through the offload engine with --hbm. "
            "Text goes through the checkpoint's tokenizer. A warm-up run (compilation) is timed "
            "apart from the reported tok/s. Text goes to stdout, timing and engine stats to "
            "stderr."),
        epilog=examples(
            'strata generate CKPT --prompt "The history of" --max-new-tokens 32',
            'strata generate CKPT --chat --prompt "Hello!" --temperature 0.7 --seed 1',
            "strata generate CKPT --prompt-ids 1,2,3 --prompt-ids 4,5 --json out.json",
            "strata generate CKPT --hbm 8GB --host-mem 64GB --prompt hi --record-heat heat.json",
            "strata generate CKPT --hbm 8GB --heat heat.json --policy lru --prompt hi"))
    gen.add_argument("ckpt", help="Strata checkpoint folder")
    gen.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                     help="prompt text (through the checkpoint's tokenizer); repeat for a batch")
    gen.add_argument("--prompt-ids", action="append", dest="prompts", type=_ids, metavar="IDS",
                     help="prompt as comma-separated token ids; repeat for a batch")
    gen.add_argument("--chat", action="store_true",
                     help="each --prompt is one user message of the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=16, metavar="N",
                     help="most tokens to generate per request")
    gen.add_argument("--no-warmup", action="store_true",
                     help="no warm-up run: the reported tok/s then includes compilation")
    gen.add_argument("--json", default=None, metavar="OUT",
                     help="write requests, timing and stats as JSON to OUT ('-': stdout only)")
    gen.add_argument("--record-heat", default=None, metavar="FILE",
                     help="write the routing statistics of the run, warm-up included "
                          "(needs --hbm)")
    gen.add_argument("--export-timeline", default=None, metavar="FILE",
                     help="write the engine's step timeline as a Chrome trace (needs --hbm)")
    _add_sampling_flags(gen)
    add_engine_flags(gen)
    add_process_flags(gen)
    gen.set_defaults(func=_generate)


# ------------------------------------------------------------------------------ plan


def _plan(args: argparse.Namespace) -> int:
    # here, not above: CLI start-up
    from strata_runtime.engine.plan import plan_for
    from strata_runtime.residency.ledger import BudgetError

    config = engine_config(args) if hasattr(args, "hbm_budget") else None
    if config is None:
        raise ValueError("plan needs the HBM budget: --hbm SIZE (e.g. 24GB or 20GiB)")
    reader = _planned_model(args)
    try:
        ledger = plan_for(reader, config)
    except BudgetError as e:
        print(e, file=sys.stderr)
        return 2
    print(ledger.render())
    floor = _tier1_line(ledger, config, reader.config)
    if floor:
        print(floor)
    if config.miss != "fetch" and not ledger.resident:
        print(_miss_lines(ledger, config, reader.config))
    return 0


def _planned_model(args: argparse.Namespace):
    """The checkpoint CKPT, or with --shape the checkpoint `strata synth` and `strata quantize`
    would write (no weights needed: a full-size model planned before it is downloaded)."""
    # here, not above: CLI start-up
    from strata_jax.formats.checkpoint import CheckpointReader, StoredModel

    if (args.ckpt is None) == (args.shape is None):
        raise ValueError("plan needs a checkpoint CKPT or --shape NAME (one of them)")
    if args.ckpt is not None:
        return CheckpointReader(args.ckpt)
    from strata_jax.tools.synth import synth_config

    cfg = synth_config(args.shape, args.layers, None, "bfloat16")
    experts = {"int4": "int4-g128", "none": "none"}[args.quant_experts]
    return StoredModel(cfg, {"dense": args.quant_dense, "experts": experts})


def _tier1_line(ledger: Ledger, config: EngineConfig, cfg: ModelConfig) -> str | None:
    """What the run will hold in tier 1 when that is more than the host budget gives (one
    device: `engine.tier1_floor`), and the knobs that lower it."""
    # here, not above: CLI start-up
    from strata_runtime.engine.plan import tier1_floor
    from strata_runtime.residency.ledger import fmt_bytes

    owned = cfg.num_layers * cfg.num_experts
    if ledger.resident or (config.expert_devices or 1) > 1:
        return None
    slots = min(owned, config.resident_experts or ledger.pool_slots)
    host = min(owned, ledger.host_share if config.host_experts is None else config.host_experts)
    cache = 0 if config.policy == "static" else int(config.cache_fraction * slots)
    if host >= owned:
        return None
    rows = max(config.batch_capacity, ledger.prefill_chunk)
    floor = tier1_floor(cfg.top_k, owned=owned, owned_per_layer=cfg.num_experts,
                        pinned=slots - cache, cache=cache, rows=rows,
                        rebalance=bool(config.rebalance_every))
    if floor <= host:
        return None
    bpe = ledger.bytes_per_expert
    return (f"tier 1: the run holds {floor} experts ({fmt_bytes(floor * bpe)}), more than "
            f"the {host} ({fmt_bytes(host * bpe)}) the host budget gives: a step that "
            f"stalls on disk resumes at a layer once its experts are all in tier 1 (top_k x "
            f"max(--batch-capacity, --prefill-chunk) = {cfg.top_k} x {rows} picks, at most a "
            "layer's experts, plus the cache slots). Give --host-mem at least "
            f"{fmt_bytes(floor * bpe)}, or lower --prefill-chunk / --batch-capacity")


def _miss_lines(ledger: Ledger, config: EngineConfig, cfg: ModelConfig) -> str:
    """The predicted split of a decode step's misses (`host_misses.predicted_split`)."""
    # here, not above: CLI start-up
    from strata_jax.model.misses import MissRates
    from strata_runtime.residency.host_misses import predicted_split

    if config.miss_rates is None:
        return (f"misses: --miss {config.miss}, split by the rates the engine measures at "
                "start-up (its stats print them as miss_rates); give --miss-rates "
                "link=GB/s,host=GB/s[,row=X] to see the split here")
    rates = MissRates.parse(config.miss_rates)
    p = predicted_split(cfg, mode=config.miss, rates=rates, tier0=ledger.tier0,
                        batch=config.batch_capacity, bytes_per_expert=ledger.bytes_per_expert)
    return (f"misses (--miss {config.miss}, {rates}), a decode step of "
            f"{config.batch_capacity} rows under uniform routing: {p['distinct']:.1f} "
            f"distinct experts per layer, {p['misses']} misses of ~{p['rows']} rows; "
            f"{p['hosted']} on the host, {p['misses'] - p['hosted']} over the link: "
            f"{p['layer_ms']:.3g} ms per layer (link alone {p['link_only_ms']:.3g} ms)")


def add_plan_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """`strata plan`."""
    plan = sub.add_parser(
        "plan", parents=[common], formatter_class=Formatter,
        help="print how an HBM budget splits (the ledger) and tiers",
        epilog=examples("strata plan CKPT --hbm 24GB --host-mem 64GB",
                        "strata plan CKPT --hbm 8GB --dequant host --staging-slots 4",
                        "strata plan --shape deepseek-v3 --experts int4 --dense int8 "
                        "--hbm 80GB --host-mem 512GB"))
    plan.add_argument("ckpt", nargs="?", default=None,
                      help="the checkpoint (or --shape: a full-size model without weights)")
    plan.add_argument("--shape", choices=SHAPE_NAMES, default=None,
                      help="plan the checkpoint `strata synth --shape` writes, quantized as "
                      "--experts / --dense say, without writing it")
    plan.add_argument("--layers", type=int, default=None,
                      help="with --shape: this many MoE layers (default: the full model's)")
    plan.add_argument("--experts", dest="quant_experts", choices=("int4", "none"),
                      default="int4", help="with --shape: the experts' storage (int4 g128 "
                      "as `strata quantize --experts int4-*` writes, or the model dtype)")
    plan.add_argument("--dense", dest="quant_dense", choices=("int8", "none"), default="none",
                      help="with --shape: the dense matrices' storage")
    add_engine_flags(plan)
    plan.set_defaults(func=_plan)


# ------------------------------------------------------------------------------ eval lm


def eval_lm(rest: list[str]) -> int:
    """`lm-eval run REST` with the model "strata" registered (and chosen, unless REST names
    another): every flag goes to lm-eval's own parser."""
    try:  # here, not above: an optional dependency, and CLI start-up
        from lm_eval.__main__ import cli_evaluate

        import strata_runtime.serving.lm_eval  # noqa: F401  (registers the model "strata")
    except ModuleNotFoundError as e:
        print(f"strata eval lm: error: {e.name} is not installed: pip install 'lm-eval[api]' "
              "(the test environment, `make test`, has it)", file=sys.stderr)
        return 2

    rest = list(rest)
    if "--model" not in rest:
        rest = ["--model", "strata", *rest]
    sys.argv = ["strata eval lm", "run", *rest]  # lm-eval's parser reads sys.argv
    cli_evaluate()
    return 0


def add_eval_lm_parser(ev_sub: argparse._SubParsersAction) -> None:
    """`strata eval lm` (EV_SUB: the subcommands of `strata eval`); `main` hands its flags to
    `eval_lm` before parsing, so this parser serves its help page."""
    evl = ev_sub.add_parser(
        "lm", formatter_class=Formatter,
        help="lm-eval's `run` with the model `strata` (runtime/serving/lm_eval.py)",
        description=describe(
            "lm-eval's command line (`lm-eval run ...`, every flag passed on) with this "
            "project's model registered and chosen: --model_args checkpoint=CKPT, plus hbm=SIZE "
            "for the offload engine and any EngineConfig field (host_mem for the host budget)."),
        epilog=examples(
            "strata eval lm --model_args checkpoint=CKPT --tasks arc_easy --limit 100",
            "strata eval lm --model_args checkpoint=CKPT,hbm=8GB,max_len=2048 --tasks "
            "hellaswag --output_path out/"))
    evl.add_argument("lm_eval_args", nargs="*", metavar="FLAG",
                     help="lm-eval run's flags (--model defaults to strata)")
    evl.set_defaults(func=lambda args: eval_lm(args.lm_eval_args))
