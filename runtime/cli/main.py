"""The `strata` command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import textwrap
import time
import warnings
from pathlib import Path

import strata_jax
from strata_jax.api import cut_at_stop
from strata_jax.step.sampling import SamplingParams
from strata_runtime.cli.engine_flags import add_engine_flags, engine_config, resident_config
from strata_runtime.cli.serve import add_serve_parser
from strata_runtime.engine.compile_cache import ENV as CACHE_ENV
from strata_runtime.engine.compile_cache import enable_compile_cache
from strata_runtime.engine.processes import add_process_flags, is_first, own_path, start_processes

__all__ = ["add_engine_flags", "build_parser", "engine_config", "main"]


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every flag's help; the examples of an epilog kept as written."""


def _describe(text: str) -> str:
    return textwrap.fill(text, 78)


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


# ------------------------------------------------------------------------------ writers


def _convert(args: argparse.Namespace) -> int:
    from strata_jax.tools.hf_convert import convert_hf

    path = convert_hf(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0


def _synth(args: argparse.Namespace) -> int:
    from strata_jax.tools.synth import synthesize

    stats = synthesize(
        args.shape,
        args.dst,
        layers=args.layers,
        skew=args.skew,
        seed=args.seed,
        dtype=args.dtype,
        overwrite=args.overwrite,
        train_steps=args.train_steps,
    )
    print(stats)
    return 0


@contextlib.contextmanager
def _warnings_as_lines(command: str):
    """Show warnings as one `strata COMMAND: warning: ...` line each (no source line), above
    any progress bar."""
    from tqdm import tqdm

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        tqdm.write(f"strata {command}: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _quantize(args: argparse.Namespace) -> int:
    from strata_jax.tools.quantize import quantize_checkpoint

    with _warnings_as_lines("quantize"):
        report = quantize_checkpoint(
            args.src,
            args.dst,
            experts=args.experts,
            dense=args.dense,
            calib=args.calib,
            calib_len=args.calib_len,
            mix_random=args.mix_random,
            damp=args.damp,
            act_order=args.act_order,
            min_tokens=args.min_tokens,
            seed=args.seed,
            overwrite=args.overwrite,
        )
    print(report)
    return 0


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


def _run_resident(args, prompts, sampling: SamplingParams) -> Run:
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


def _run_engine(args, config, prompts, sampling: SamplingParams, tok) -> Run:
    from strata_runtime.engine.offload import Engine

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


def _timed(args, run, load_s: float, engine) -> Run:
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


def _requests(prompts, out, tok, args, sampling) -> list[dict[str, object]]:
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


def _print_requests(reqs, given) -> None:
    for i, (req, prompt) in enumerate(zip(reqs, given, strict=True)):
        if len(reqs) > 1:
            print(f"--- request {i}: {len(req['prompt_ids'])} prompt tokens, "
                  f"{len(req['new_ids'])} new ({req['finish']})")
        if not isinstance(prompt, str) or "text" not in req:
            print(f"{req['prompt_ids']} -> {req['new_ids']}")
        if "text" in req:
            print(req["text"])


def _timing(run: Run, reqs) -> dict[str, object]:
    new = sum(len(r) for r in run.tokens)
    return {"load_s": run.load_s, "warmup_s": run.warmup_s, "run_s": run.run_s,
            "prompt_tokens": sum(len(r["prompt_ids"]) for r in reqs), "new_tokens": new,
            "tok_s": new / run.run_s if run.run_s > 0 else None,
            "includes_compilation": run.warmup_s is None}


def _report(timing: dict[str, object], stats) -> str:
    from strata_runtime.engine.stats import render

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


def _check_requests(args: argparse.Namespace, given: list, prompts: list[list[int]],
                    max_len: int) -> None:
    """Every request checked as every path checks it (`checks.check_request`) before anything
    loads, the error naming the flags that set the values at fault."""
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
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _generate(args: argparse.Namespace) -> int:
    from strata_jax.formats.tokenizer import encode_prompts, load_tokenizer

    config = engine_config(args)
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
    for name, kind in (("temperature", float), ("top_k", int), ("top_p", float),
                       ("min_p", float), ("repetition_penalty", float), ("seed", int)):
        doc = _field_doc(SamplingParams, name)
        group.add_argument("--" + name.replace("_", "-"), type=kind,
                           metavar="N" if kind is int else "X",
                           default=getattr(defaults, name), help=doc.replace("%", "%%"))
    group.add_argument("--stop", action="append", default=[], metavar="STR",
                       help="end a request at this text (cut before it); repeatable")
    group.add_argument("--stop-id", action="append", default=[], type=int, metavar="N",
                       help="end a request at this token id (kept); repeatable")
    group.add_argument("--ignore-eos", action="store_true",
                       help="do not stop at the tokenizer's end-of-sequence ids")


def _field_doc(cls: type, name: str) -> str:
    from strata_runtime.cli.engine_flags import field_docs

    return field_docs(cls).get(name, "")


def _add_generate_parser(sub: argparse._SubParsersAction, common) -> None:
    gen = sub.add_parser(
        "generate", parents=[common], formatter_class=_Formatter,
        help="generate text or ids (resident, or offloaded with --hbm)",
        description=_describe(
            "Generate from prompts: resident by default, through the offload engine with --hbm. "
            "Text goes through the checkpoint's tokenizer. A warm-up run (compilation) is timed "
            "apart from the reported tok/s. Text goes to stdout, timing and engine stats to "
            "stderr."),
        epilog=_examples(
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


# ------------------------------------------------------------------------------ plan, eval


def _plan(args: argparse.Namespace) -> int:
    from strata_jax.formats.checkpoint import CheckpointReader
    from strata_runtime.engine.plan import plan_for
    from strata_runtime.residency.ledger import BudgetError

    config = engine_config(args) if hasattr(args, "hbm_budget") else None
    if config is None:
        raise ValueError("plan needs the HBM budget: --hbm SIZE (e.g. 24GB or 20GiB)")
    reader = CheckpointReader(args.ckpt)
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


def _tier1_line(ledger, config, cfg) -> str | None:
    """What the run will hold in tier 1 when that is more than the host budget gives (one
    device: `engine.tier1_floor`), and the knobs that lower it."""
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


def _miss_lines(ledger, config, cfg) -> str:
    """The predicted split of a decode step's misses (`host_misses.predicted_split`)."""
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


def _eval_lm(rest: list[str]) -> int:
    """`lm-eval run REST` with the model "strata" registered (and chosen, unless REST names
    another): every flag goes to lm-eval's own parser."""
    try:
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


def _eval_quant(args: argparse.Namespace) -> int:
    from strata_jax.tools.quant_eval import evaluate_quantization, write_json

    result = evaluate_quantization(
        args.ckpt,
        args.ref,
        tokens=args.tokens,
        seq_len=args.seq_len,
        seed=args.seed,
        token_file=args.token_file,
        min_expert_tokens=args.min_expert_tokens,
    )
    print(result.table())
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


def _eval_ppl(args: argparse.Namespace) -> int:
    from strata_jax.tools.perplexity import evaluate_perplexity, write_json

    report = evaluate_perplexity(args.ckpt, args.text, ref=args.ref, seq_len=args.seq_len,
                                 stride=args.stride, batch=args.batch)
    print(report.table())
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0


def _add_quantize_parsers(sub: argparse._SubParsersAction, common) -> None:
    """`strata quantize`, `strata eval quant` and `strata eval ppl`."""
    qua = sub.add_parser(
        "quantize", parents=[common], formatter_class=_Formatter,
        help="quantize a float checkpoint (int4 experts, int8 dense)",
        epilog=_examples("strata quantize CKPT CKPT-int4 --experts int4-gptq --dense int8",
                         "strata quantize CKPT CKPT-rtn --experts int4-rtn --calib 0"))
    qua.add_argument("src", help="float Strata checkpoint")
    qua.add_argument("dst")
    qua.add_argument("--experts", choices=("int4-gptq", "int4-rtn", "none"), default="int4-gptq",
                     help="routed experts: int4 g128 by GPTQ or round-to-nearest, or kept float")
    qua.add_argument("--dense", choices=("int8", "int8-gptq", "none"), default="int8",
                     help="attention + shared-expert matrices: int8 by RTN or GPTQ, or float")
    qua.add_argument("--calib", default="64", metavar="FILE_OR_N",
                     help="token file (.npy [N, T] ints or .json list of lists), or a number of "
                          "sequences to sample from the float model (loads it whole)")
    qua.add_argument("--calib-len", type=int, default=64, help="length of sampled sequences")
    qua.add_argument("--mix-random", type=float, default=0.25,
                     help="fraction of calibration sequences that are uniform-random tokens")
    qua.add_argument("--act-order", action="store_true")
    qua.add_argument("--damp", type=float, default=0.01)
    qua.add_argument("--min-tokens", type=int, default=None,
                     help="fewest routed calibration tokens for GPTQ (default 2*K), else RTN")
    qua.add_argument("--seed", type=int, default=0)
    qua.add_argument("--overwrite", action="store_true")
    qua.set_defaults(func=_quantize)

    ev = sub.add_parser("eval", help="evaluate a checkpoint")
    ev_sub = ev.add_subparsers(dest="what", required=True)
    evq = ev_sub.add_parser(
        "quant", parents=[common], formatter_class=_Formatter,
        help="quantized vs float: expert errors, logits KL, bytes",
        epilog=_examples("strata eval quant CKPT-int4 --ref CKPT --json quant.json"))
    evq.add_argument("ckpt", help="quantized Strata checkpoint")
    evq.add_argument("--ref", required=True, help="its float source checkpoint")
    evq.add_argument("--tokens", type=int, default=32,
                     help="held-out sequences to sample from the float model")
    evq.add_argument("--seq-len", type=int, default=64)
    evq.add_argument("--token-file", default=None, help="extra held-out tokens (.npy / .json)")
    evq.add_argument("--min-expert-tokens", type=int, default=32,
                     help="skip experts with fewer held-out tokens in the error comparison")
    evq.add_argument("--seed", type=int, default=0)
    evq.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    evq.set_defaults(func=_eval_quant)

    evl = ev_sub.add_parser(
        "lm", formatter_class=_Formatter,
        help="lm-eval's `run` with the model `strata` (runtime/serving/lm_eval.py)",
        description=_describe(
            "lm-eval's command line (`lm-eval run ...`, every flag passed on) with this "
            "project's model registered and chosen: --model_args checkpoint=CKPT, plus hbm=SIZE "
            "for the offload engine and any EngineConfig field (host_mem for the host budget)."),
        epilog=_examples(
            "strata eval lm --model_args checkpoint=CKPT --tasks arc_easy --limit 100",
            "strata eval lm --model_args checkpoint=CKPT,hbm=8GB,max_len=2048 --tasks "
            "hellaswag --output_path out/"))
    evl.add_argument("lm_eval_args", nargs="*", metavar="FLAG",
                     help="lm-eval run's flags (--model defaults to strata)")
    evl.set_defaults(func=lambda args: _eval_lm(args.lm_eval_args))

    evp = ev_sub.add_parser(
        "ppl", parents=[common], formatter_class=_Formatter,
        help="perplexity on a text file through the checkpoint's tokenizer",
        description=_describe(
            "Perplexity of the checkpoint (and of --ref side by side) on a UTF-8 text, in "
            "windows of --seq-len tokens starting --stride apart; NLL summed in float64 "
            "(strata_jax/tools/perplexity.py)."),
        epilog=_examples("strata eval ppl CKPT --text tests/data/public_domain.txt",
                         "strata eval ppl CKPT-int4 --ref CKPT --text book.txt --json ppl.json"))
    evp.add_argument("ckpt", help="Strata checkpoint with a tokenizer (e.g. quantized)")
    evp.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text file")
    evp.add_argument("--ref", default=None, metavar="FLOAT_CKPT",
                     help="a second checkpoint of the same model (its float source), shown "
                          "side by side")
    evp.add_argument("--seq-len", type=int, default=256, help="most input tokens per window")
    evp.add_argument("--stride", type=int, default=None,
                     help="tokens between window starts (default: --seq-len, no overlap)")
    evp.add_argument("--batch", type=int, default=8, help="windows per forward")
    evp.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    evp.set_defaults(func=_eval_ppl)


# ------------------------------------------------------------------------------ traces


def _trace_stats(args: argparse.Namespace) -> int:
    from strata_runtime.engine.trace import load_trace, trace_stats

    trace = load_trace(args.trace)
    print(f"{args.trace}: {trace.num_layers} layers, {trace.num_experts} experts, "
          f"top-{trace.top_k}, seed {trace.seed}")
    print(trace_stats(trace).render())
    return 0


def _trace_synth(args: argparse.Namespace) -> int:
    from strata_runtime.engine.trace import save_trace, synthetic_trace

    trace = synthetic_trace(args.layers, args.experts, args.top_k, args.steps, args.rows,
                            args.skew, args.seed, drift_at=args.drift_at)
    save_trace(args.out, trace)
    print(f"wrote {args.out}: {trace.num_steps} steps of {args.rows} rows")
    return 0


def _model_cost(args: argparse.Namespace, trace):
    """The bytes and FLOPs of the traced model: the flags, else --shape, else the trace's
    `model_config` metadata (its `bytes_per_expert`, if recorded, over the bf16 size)."""
    from strata_jax.formats.config import ModelConfig
    from strata_runtime.lab.cost_model import ModelCost, model_cost

    cfg = None
    if args.shape is not None:
        from strata_jax.tools.synth import SHAPES

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


def _simulate(args: argparse.Namespace) -> int:
    from strata_runtime.engine.trace import load_trace
    from strata_runtime.lab.cost_model import profile
    from strata_runtime.lab.simulate import compare, pinned_by_heat, predict_replay
    from strata_runtime.residency.cache_policy import POLICIES

    hw = profile(args.hardware)
    trace = load_trace(args.trace)
    model = _model_cost(args, trace)
    total = trace.num_layers * trace.num_experts
    pinned_n = total // 4 if args.pinned is None else args.pinned
    cache = total // 8 if args.cache is None else args.cache
    staging = args.staging if args.staging is not None else min(
        trace.num_experts, trace.top_k * int(trace.live_rows().max(initial=1)))
    pinned = pinned_by_heat(trace, pinned_n)
    results, opt = compare(trace, args.policy or POLICIES, pinned=pinned, cache=cache,
                           staging=staging, admission=args.admission,
                           cache_admit=args.cache_admit)
    print(f"{args.trace} on {hw.name}: {len(pinned)} pinned (hottest of the trace), {cache} "
          f"cache slots, {staging} staging slots, {args.admission} admission "
          f"({args.cache_admit}), "
          f"{model.bytes_per_expert / 1e6:.3g} MB per expert, {model.dense_bytes / 1e9:.3g} GB "
          f"dense, {trace.num_steps} steps\n")
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
    print(f"\nat best (Belady's cache, perfect prefetch): {best.tok_s:.4g} tok/s, bound by "
          f"{best.binding} ({', '.join(f'{k} {1e3 * v:.3g} ms' for k, v in best.terms.items())})")
    if hw.reported:
        print(f"reported on {hw.name}: {hw.reported}")
    print("predicted tok/s: misses prefetched in time " f"{args.hidden:.0%} (--hidden); "
          f"misses --miss {args.miss}; copies include the engine's admissions "
          "(strata_runtime.lab.cost_model)")
    return 0


def _add_trace_parsers(sub: argparse._SubParsersAction, common) -> None:
    """`strata trace stats`, `strata trace synth` and `strata simulate`."""
    from strata_runtime.lab.cost_model import PROFILES
    from strata_runtime.lab.simulate import ADMISSIONS
    from strata_runtime.residency.cache_policy import ADMITS, POLICIES
    from strata_runtime.residency.ledger import parse_bytes

    tr = sub.add_parser("trace", help="routing traces: statistics, synthetic ones")
    tr_sub = tr.add_subparsers(dest="what", required=True)
    st = tr_sub.add_parser(
        "stats", parents=[common], formatter_class=_Formatter,
        help="per-layer popularity and the reuse-distance histogram of a trace",
        epilog=_examples("strata trace stats run.trace.npz"))
    st.add_argument("trace", help="routing trace (.npz, strata_runtime/trace.py)")
    st.set_defaults(func=_trace_stats)
    sy = tr_sub.add_parser(
        "synth", parents=[common], formatter_class=_Formatter,
        help="write a synthetic decode trace with Zipf-like expert popularity",
        epilog=_examples("strata trace synth skew.npz --layers 8 --experts 64 --top-k 4 "
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

    sim = sub.add_parser(
        "simulate", parents=[common], formatter_class=_Formatter,
        help="replay a trace through the cache policies, Belady and the cost model",
        description=_describe(
            "Replay a routing trace through the engine's cache policies (its ExpertCache, fed "
            "as the engine feeds it), Belady's optimum on the same pinned set and cache slots, "
            "and a perfect prefetcher; predict decode tok/s on a hardware profile "
            "(strata_runtime/cost_model.py) and name the binding resource."),
        epilog=_examples("strata simulate run.npz --hardware h200-pcie5 --shape mixtral-8x7b",
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
    sim.add_argument("--shape", default=None,
                     choices=("tiny", "mixtral-8x7b", "qwen3-30b-a3b", "seed-125b"),
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


def _bench_config(args: argparse.Namespace):
    """The EngineConfig of the engine flags; without --hbm every expert gets an HBM slot
    (hbm_budget None), unless --resident-experts and the like say otherwise."""
    ns = argparse.Namespace(**vars(args))
    if not hasattr(ns, "hbm_budget"):
        ns.hbm_budget = None
    return engine_config(ns)


def _bench(args: argparse.Namespace) -> int:
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
    from strata_runtime.lab.sweep import describe, finish, load_sweep, prepare, run_sweep, runnable

    sweep = load_sweep(args.sweep, checkpoint=args.checkpoint)
    if args.dry_run:
        print(describe(sweep))
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


def _add_bench_parsers(sub: argparse._SubParsersAction, common) -> None:
    """`strata bench` and `strata sweep`."""
    from strata_runtime.lab.bench import BenchSettings
    from strata_runtime.lab.cost_model import PROFILES

    defaults = BenchSettings()
    b = sub.add_parser(
        "bench", parents=[common], formatter_class=_Formatter,
        help="repeated, fingerprinted tok/s of the engine, beside its bound and the cost model",
        description=_describe(
            "Bench the offload engine on synthetic prompts drawn from --seed: a warm-up run "
            "(compilation) apart, then --repeats timed runs with the counters reset before "
            "each. Prints the median tok/s with a 95% percentile-bootstrap interval, step "
            "p50/p99, hit rates, bytes per tier, the bound from the counted bytes and FLOPs "
            "over ceilings measured at the start, and the cost model's prediction. Without "
            "--hbm every expert gets an HBM slot (runtime/lab/bench.py)."),
        epilog=_examples(
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

    sw = sub.add_parser(
        "sweep", parents=[common], formatter_class=_Formatter,
        help="bench a ladder or grid of engine knobs from a TOML file: table and plot",
        description=_describe(
            "Run `strata bench` in this process for every [[rung]] (or every point of a "
            "[grid]) of a TOML file, each on a fresh engine; rows are appended to "
            "OUT/sweep.jsonl as they finish, then OUT/sweep.md (printed) and OUT/sweep.png "
            "are written. Every rung is checked before anything runs. The schema: "
            "runtime/lab/sweep.py and docs/design.md, 'Benchmarks and sweeps'."),
        epilog=_examples("strata sweep sweeps/tiny_ladder.toml --out /tmp/tiny",
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata", description=__doc__, formatter_class=_Formatter,
        epilog=_examples("strata synth --shape tiny tiny",
                         'strata generate tiny --prompt "Four score" --max-new-tokens 16',
                         "strata plan CKPT --hbm 24GB --host-mem 64GB",
                         "strata serve CKPT --port 8000",
                         "strata <command> --help"))
    parser.add_argument("--version", action="version",
                        version=f"strata {strata_jax.__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-compile-cache", action="store_true",
                        help=f"do not use JAX's persistent compilation cache (also: {CACHE_ENV}"
                             "=off; a folder there moves it)")
    sub = parser.add_subparsers(dest="command", required=True)

    conv = sub.add_parser("convert", help="convert a checkpoint into the Strata format")
    conv_sub = conv.add_subparsers(dest="source", required=True)
    hf = conv_sub.add_parser(
        "hf", parents=[common], formatter_class=_Formatter,
        help="from a Hugging Face safetensors directory (with its tokenizer files)",
        epilog=_examples("strata convert hf ~/models/Mixtral-8x7B-v0.1 mixtral --dtype bfloat16"))
    hf.add_argument("src")
    hf.add_argument("dst")
    hf.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="storage dtype (default: the source's torch_dtype/dtype)")
    hf.add_argument("--overwrite", action="store_true")
    hf.set_defaults(func=_convert)

    syn = sub.add_parser(
        "synth", parents=[common], formatter_class=_Formatter,
        help="write a synthetic model with random weights (and a byte-level tokenizer)",
        epilog=_examples("strata synth --shape tiny --skew 0.7 tiny",
                         "strata synth --shape mixtral-8x7b --layers 8 mixtral8"))
    syn.add_argument("--shape", required=True,
                     choices=("tiny", "mixtral-8x7b", "qwen3-30b-a3b", "seed-125b"))
    syn.add_argument("--layers", type=int, default=None, help="override the number of layers")
    syn.add_argument("--skew", type=float, default=None,
                     help="target share of routing assignments taken by the top 20%% of experts")
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    syn.add_argument("--overwrite", action="store_true")
    syn.add_argument("--train-steps", type=int, default=0, metavar="N",
                     help="then train it N Adam steps on a Markov language (tiny models only)")
    syn.add_argument("dst")
    syn.set_defaults(func=_synth)

    _add_generate_parser(sub, common)
    plan = sub.add_parser(
        "plan", parents=[common], formatter_class=_Formatter,
        help="print how an HBM budget splits (the ledger) and tiers",
        epilog=_examples("strata plan CKPT --hbm 24GB --host-mem 64GB",
                         "strata plan CKPT --hbm 8GB --dequant host --staging-slots 4"))
    plan.add_argument("ckpt")
    add_engine_flags(plan)
    plan.set_defaults(func=_plan)
    _add_quantize_parsers(sub, common)
    _add_trace_parsers(sub, common)
    _add_bench_parsers(sub, common)
    add_serve_parser(sub, add_engine_flags)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["eval", "lm"] and not {"-h", "--help"} & set(argv[2:]):
        return _eval_lm(argv[2:])  # lm-eval's flags, parsed by lm-eval
    args = build_parser().parse_args(argv)
    try:
        start_processes(args)  # before anything starts a JAX backend
        enable_compile_cache(not getattr(args, "no_compile_cache", False))
        return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError, RuntimeError) as e:
        print(f"strata {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
