"""The `strata` commands that write or judge checkpoints: `convert hf`, `synth`, `quantize`,
`eval quant` and `eval ppl` (strata_jax/tools)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator

from strata_runtime.cli.helptext import Formatter, describe, examples

__all__ = ["SHAPE_NAMES", "add_convert_parser", "add_eval_ppl_parser", "add_eval_quant_parser",
           "add_quantize_parser", "add_synth_parser"]

SHAPE_NAMES = ("tiny", "mixtral-8x7b", "qwen3-30b-a3b", "seed-125b", "deepseek-v3", "glm-4.5-air",
               "minimax-m2", "gpt-oss-20b", "gpt-oss-120b", "qwen3-next-80b-a3b")
"""The shapes of strata_jax.tools.synth.SHAPES, named without importing it."""


# ------------------------------------------------------------------------------ commands


def _convert(args: argparse.Namespace) -> int:
    from strata_jax.tools.hf_convert import convert_hf  # here, not above: CLI start-up

    path = convert_hf(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite,
                      experts=args.experts, dense=args.dense)
    print(f"wrote {path}")
    if (args.experts, args.dense) != ("none", "none"):
        print(f"how each weight was quantized, each expert's error against the source: "
              f"{path / 'quantize_report.json'}")
    return 0


def _synth(args: argparse.Namespace) -> int:
    from strata_jax.tools.synth import synthesize  # here, not above: CLI start-up

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
def _warnings_as_lines(command: str) -> Iterator[None]:
    """Show warnings as one `strata COMMAND: warning: ...` line each (no source line), above
    any progress bar."""
    from tqdm import tqdm  # here, not above: CLI start-up

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        tqdm.write(f"strata {command}: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _quantize(args: argparse.Namespace) -> int:
    from strata_jax.tools.quantize import quantize_checkpoint  # here, not above: CLI start-up

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
    # here, not above: CLI start-up
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
    # here, not above: CLI start-up
    from strata_jax.tools.perplexity import evaluate_perplexity, write_json

    report = evaluate_perplexity(args.ckpt, args.text, ref=args.ref, seq_len=args.seq_len,
                                 stride=args.stride, batch=args.batch)
    print(report.table())
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0


# ------------------------------------------------------------------------------ parsers


def add_convert_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """`strata convert hf`."""
    conv = sub.add_parser("convert", help="convert a checkpoint into the Strata format")
    conv_sub = conv.add_subparsers(dest="source", required=True)
    hf = conv_sub.add_parser(
        "hf", parents=[common], formatter_class=Formatter,
        help="from a Hugging Face safetensors directory (with its tokenizer files)",
        description=describe(
            "Float (float32/float16/bfloat16) and block-FP8 (DeepSeek-V3 style, "
            "quant_method fp8) sources; FP8 weights are dequantized one tensor at a time. "
            "--experts/--dense quantize while converting, with the bits and the "
            "quantize_report.json of `strata quantize` by round-to-nearest."),
        epilog=examples("strata convert hf ~/models/Mixtral-8x7B-v0.1 mixtral --dtype bfloat16",
                        "strata convert hf ~/models/Qwen3-30B-A3B-FP8 qwen3-int4 "
                        "--experts int4-rtn --dense int8"))
    hf.add_argument("src")
    hf.add_argument("dst")
    hf.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="storage dtype (default: the source's torch_dtype/dtype)")
    hf.add_argument("--experts", choices=("int4-rtn", "none"), default="none",
                    help="routed experts: int4 g128 by round-to-nearest, or kept float (GPTQ "
                         "needs calibration: convert, then `strata quantize`)")
    hf.add_argument("--dense", choices=("int8", "none"), default="none",
                    help="attention + shared-expert matrices: int8 by RTN, or float (int8-gptq: "
                         "convert, then `strata quantize`)")
    hf.add_argument("--overwrite", action="store_true")
    hf.set_defaults(func=_convert)


def add_synth_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """`strata synth`."""
    syn = sub.add_parser(
        "synth", parents=[common], formatter_class=Formatter,
        help="write a synthetic model with random weights (and a byte-level tokenizer)",
        epilog=examples("strata synth --shape tiny --skew 0.7 tiny",
                        "strata synth --shape mixtral-8x7b --layers 8 mixtral8"))
    syn.add_argument("--shape", required=True, choices=SHAPE_NAMES)
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


def add_quantize_parser(sub: argparse._SubParsersAction,
                        common: argparse.ArgumentParser) -> None:
    """`strata quantize`."""
    qua = sub.add_parser(
        "quantize", parents=[common], formatter_class=Formatter,
        help="quantize a float checkpoint (int4 experts, int8 dense)",
        epilog=examples("strata quantize CKPT CKPT-int4 --experts int4-gptq --dense int8",
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


def add_eval_quant_parser(ev_sub: argparse._SubParsersAction,
                          common: argparse.ArgumentParser) -> None:
    """`strata eval quant` (EV_SUB: the subcommands of `strata eval`)."""
    evq = ev_sub.add_parser(
        "quant", parents=[common], formatter_class=Formatter,
        help="quantized vs float: expert errors, logits KL, bytes",
        epilog=examples("strata eval quant CKPT-int4 --ref CKPT --json quant.json"))
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


def add_eval_ppl_parser(ev_sub: argparse._SubParsersAction,
                        common: argparse.ArgumentParser) -> None:
    """`strata eval ppl` (EV_SUB: the subcommands of `strata eval`)."""
    evp = ev_sub.add_parser(
        "ppl", parents=[common], formatter_class=Formatter,
        help="perplexity on a text file through the checkpoint's tokenizer",
        description=describe(
            "Perplexity of the checkpoint (and of --ref side by side) on a UTF-8 text, in "
            "windows of --seq-len tokens starting --stride apart; NLL summed in float64 "
            "(strata_jax/tools/perplexity.py)."),
        epilog=examples("strata eval ppl CKPT --text tests/data/public_domain.txt",
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
