"""The `strata` command line: the parser, assembled from the command modules (`tools`: convert,
synth, quantize, eval quant/ppl; `run`: generate, plan, eval lm; `lab`: trace, simulate, bench,
sweep; `serve`), and the dispatch to the command chosen."""

from __future__ import annotations

import argparse
import sys

import strata_jax
from strata_runtime.cli import lab, run, tools
from strata_runtime.cli.engine_flags import add_engine_flags, engine_config
from strata_runtime.cli.helptext import Formatter, examples
from strata_runtime.cli.serve import add_serve_parser
from strata_runtime.engine.compile_cache import ENV as CACHE_ENV
from strata_runtime.engine.compile_cache import enable_compile_cache
from strata_runtime.engine.processes import start_processes

__all__ = ["add_engine_flags", "build_parser", "engine_config", "main"]

DESCRIPTION = "The `strata` command line."
"""The description of `strata --help`."""


def _common() -> argparse.ArgumentParser:
    """The parent parser of the commands that start JAX: the flags they share."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-compile-cache", action="store_true",
                        help=f"do not use JAX's persistent compilation cache (also: {CACHE_ENV}"
                             "=off; a folder there moves it)")
    return common


def _add_eval_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """`strata eval quant`, `strata eval lm` and `strata eval ppl`."""
    ev = sub.add_parser("eval", help="evaluate a checkpoint")
    ev_sub = ev.add_subparsers(dest="what", required=True)
    tools.add_eval_quant_parser(ev_sub, common)
    run.add_eval_lm_parser(ev_sub)
    tools.add_eval_ppl_parser(ev_sub, common)


def build_parser() -> argparse.ArgumentParser:
    """The `strata` parser: every command, in the order its help lists them."""
    parser = argparse.ArgumentParser(
        prog="strata", description=DESCRIPTION, formatter_class=Formatter,
        epilog=examples("strata synth --shape tiny tiny",
                        'strata generate tiny --prompt "Four score" --max-new-tokens 16',
                        "strata plan CKPT --hbm 24GB --host-mem 64GB",
                        "strata serve CKPT --port 8000",
                        "strata <command> --help"))
    parser.add_argument("--version", action="version",
                        version=f"strata {strata_jax.__version__}")
    common = _common()
    sub = parser.add_subparsers(dest="command", required=True)
    tools.add_convert_parser(sub, common)
    tools.add_synth_parser(sub, common)
    run.add_generate_parser(sub, common)
    run.add_plan_parser(sub, common)
    tools.add_quantize_parser(sub, common)
    _add_eval_parsers(sub, common)
    lab.add_trace_parsers(sub, common)
    lab.add_simulate_parser(sub, common)
    lab.add_bench_parser(sub, common)
    lab.add_sweep_parser(sub, common)
    add_serve_parser(sub, add_engine_flags)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `strata ARGV` (default: the process's arguments); returns the exit status, 2 for an
    error the command reports as `strata COMMAND: error: ...`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["eval", "lm"] and not {"-h", "--help"} & set(argv[2:]):
        return run.eval_lm(argv[2:])  # lm-eval's flags, parsed by lm-eval
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
