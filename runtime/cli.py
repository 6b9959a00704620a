"""The `strata` command line."""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings


def _convert(args: argparse.Namespace) -> int:
    from strata_jax.hf_convert import convert_hf

    path = convert_hf(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0


def _synth(args: argparse.Namespace) -> int:
    from strata_jax.synth import synthesize

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


def _generate(args: argparse.Namespace) -> int:
    import time

    prompts = [[int(t) for t in p.split(",")] for p in args.prompt]
    if args.hbm is None:
        import strata_jax

        model = strata_jax.load(args.ckpt)
        t0 = time.perf_counter()
        out = strata_jax.generate(model, prompts, args.max_new_tokens, max_len=args.max_len)
        stats = None
    else:
        from strata_runtime.engine import Engine, EngineConfig

        config = EngineConfig(hbm_budget=args.hbm, host_budget=args.host,
                              max_len=args.max_len, heat_file=args.heat,
                              staging_slots=args.staging_slots, dequant=args.dequant)
        with Engine.from_checkpoint(args.ckpt, config) as engine:
            t0 = time.perf_counter()
            out = engine.generate(prompts, args.max_new_tokens)
            stats = engine.stats()
            if args.record_heat:
                engine.save_heat(args.record_heat)
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, out, strict=True):
        print(f"{p} -> {o}")
    print(f"{sum(map(len, out))} tokens in {dt:.2f}s (includes compilation)")
    if stats is not None:
        from strata_runtime.stats import render

        print("engine stats:")
        print(render(stats))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from strata_jax.checkpoint import CheckpointReader
    from strata_runtime.engine import EngineConfig, plan_for
    from strata_runtime.ledger import BudgetError

    config = EngineConfig(hbm_budget=args.hbm, host_budget=args.host,
                          batch_capacity=args.batch_capacity, max_len=args.max_len,
                          staging_slots=args.staging_slots, dequant=args.dequant)
    try:
        ledger = plan_for(CheckpointReader(args.ckpt), config)
    except BudgetError as e:
        print(e, file=sys.stderr)
        return 2
    print(ledger.render())
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
    from strata_jax.quantize import quantize_checkpoint

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


def _eval_quant(args: argparse.Namespace) -> int:
    from strata_jax.quant_eval import evaluate_quantization, write_json

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


def _add_quantize_parsers(sub: argparse._SubParsersAction) -> None:
    """`strata quantize` and `strata eval quant`."""
    qua = sub.add_parser("quantize", help="quantize a float checkpoint (int4 experts, int8 dense)")
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
    evq = ev_sub.add_parser("quant", help="quantized vs float: expert errors, logits KL, bytes")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    conv = sub.add_parser("convert", help="convert a checkpoint into the Strata format")
    conv_sub = conv.add_subparsers(dest="source", required=True)
    hf = conv_sub.add_parser("hf", help="from a Hugging Face safetensors directory")
    hf.add_argument("src")
    hf.add_argument("dst")
    hf.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="storage dtype (default: the source's torch_dtype/dtype)")
    hf.add_argument("--overwrite", action="store_true")
    hf.set_defaults(func=_convert)

    syn = sub.add_parser("synth", help="write a synthetic model with random weights")
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

    gen = sub.add_parser("generate", help="greedy generation (resident, or offloaded with --hbm)")
    gen.add_argument("ckpt")
    gen.add_argument("--prompt", action="append", required=True,
                     help="comma-separated token ids; repeat for a batch")
    gen.add_argument("--max-new-tokens", type=int, default=16)
    gen.add_argument("--hbm", default=None,
                     help="HBM budget (e.g. 8GB): run through the offload engine")
    gen.add_argument("--host", default=None, help="host budget for tier-1 experts")
    gen.add_argument("--max-len", type=int, default=256)
    gen.add_argument("--heat", default=None, metavar="FILE",
                     help="routing statistics ranking the experts into tiers (with --hbm)")
    gen.add_argument("--record-heat", default=None, metavar="FILE",
                     help="write this run's routing statistics (with --hbm)")
    gen.set_defaults(func=_generate)
    plan = sub.add_parser("plan", help="print how an HBM budget splits (the ledger) and tiers")
    plan.add_argument("ckpt")
    plan.add_argument("--hbm", required=True, help="HBM budget, e.g. 24GB or 20GiB")
    plan.add_argument("--host", default=None, help="host (pinned RAM) budget for tier 1")
    plan.add_argument("--batch-capacity", type=int, default=16)
    plan.add_argument("--max-len", type=int, default=4096)
    for p in (gen, plan):
        p.add_argument("--staging-slots", type=int, default=None, metavar="N",
                       help="experts per staging buffer (default: ledger.default_staging_slots)")
        p.add_argument("--dequant", choices=("device", "host"), default="device",
                       help="int4 experts: dequantized in the kernel, or on the host (bf16 slots)")
    plan.set_defaults(func=_plan)
    _add_quantize_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError, RuntimeError) as e:
        print(f"strata {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
