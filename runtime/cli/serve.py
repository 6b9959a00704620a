"""`strata serve` (also `python -m strata_runtime.cli.serve`): its flags, and the command that
loads the engine and runs the server (`serving.server`) until SIGINT/SIGTERM. The web stack is
imported only when a server is asked for, so every other subcommand of the CLI runs without it
(the GPU machine's environment, for one)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("strata.serve")

DESCRIPTION = ("An OpenAI-compatible HTTP server on the continuous-batching scheduler: "
               "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics. "
               "See strata_runtime.serving.server.")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (the engine's come from `engine_flags.add_engine_flags`)."""
    parser.add_argument("ckpt", help="Strata checkpoint folder (with its tokenizer)")
    group = parser.add_argument_group("server")
    group.add_argument("--no-compile-cache", action="store_true",
                       help="do not use JAX's persistent compilation cache "
                            "(also: STRATA_COMPILE_CACHE=off)")
    group.add_argument("--host", dest="bind", default="127.0.0.1", metavar="ADDRESS",
                       help="address to listen on, as in vLLM and llama-server (default: "
                            "127.0.0.1; any other needs an API key). The host-memory budget "
                            "is --host-mem")
    group.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    group.add_argument("--api-key", default=None,
                       help="required as 'Authorization: Bearer KEY' (default: the "
                            "STRATA_API_KEY environment variable, else none)")
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients name (default: the checkpoint folder's name)")
    group.add_argument("--max-queue", type=int, default=64,
                       help="requests waiting for a row beyond the batch; more get 429 "
                            "(default: 64)")
    group.add_argument("--max-prompt-tokens", type=int, default=None,
                       help="longest prompt accepted (default: max_len - 1)")
    group.add_argument("--max-body-bytes", type=int, default=1 << 20,
                       help="largest request body (default: 1 MiB)")
    group.add_argument("--drain-seconds", type=float, default=10.0,
                       help="on SIGINT/SIGTERM, time requests in flight get to finish "
                            "(default: 10)")
    group.add_argument("--no-warmup", action="store_true",
                       help="do not compile every program before serving")
    group.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"))


def add_serve_parser(subparsers: argparse._SubParsersAction,
                     add_engine_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    """`strata serve` in the CLI's subcommands."""
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)",
        description=DESCRIPTION)
    add_serve_arguments(parser)
    add_engine_flags(parser, host_moved=False)
    parser.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    """Load, warm up and serve until SIGINT/SIGTERM."""
    # the web stack and the engine load only when a server is asked for (`strata --help` and
    # the other commands start without them)
    import uvicorn

    from strata_jax.formats.checkpoint import CheckpointReader
    from strata_jax.formats.tokenizer import load_tokenizer
    from strata_runtime.cli.engine_flags import engine_config, resident_config
    from strata_runtime.engine.compile_cache import enable_compile_cache
    from strata_runtime.engine.config import context_max_len
    from strata_runtime.engine.offload import Engine
    from strata_runtime.serving.access import check_bind
    from strata_runtime.serving.loop import EngineLoop, warm_up
    from strata_runtime.serving.server import (
        GRACE_S,
        DrainingServer,
        ServerConfig,
        Service,
        create_app,
    )

    api_key = args.api_key or os.environ.get("STRATA_API_KEY") or None
    check_bind(args.bind, api_key)
    enable_compile_cache(not args.no_compile_cache)  # a restarted server does not recompile
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    config = engine_config(args) or resident_config(args)
    tokenizer = load_tokenizer(args.ckpt)
    _log_to_stderr(args.log_level)
    reader = CheckpointReader(args.ckpt)
    if not hasattr(args, "max_len"):
        config, why = context_max_len(config, reader)
        log.info("%s", why)
    engine = Engine(reader, config)
    if not args.no_warmup:
        t0 = time.perf_counter()
        warm_up(engine)
        log.info("warm-up (compilation) took %.1f s", time.perf_counter() - t0)
    server_config = ServerConfig(
        model_name=args.served_model_name or Path(args.ckpt).resolve().name, api_key=api_key,
        max_prompt_tokens=args.max_prompt_tokens or config.max_len - 1,
        max_body_bytes=args.max_body_bytes, drain_s=args.drain_seconds)
    loop = EngineLoop(engine, max_queue=args.max_queue)
    app = create_app(Service(loop, tokenizer, server_config))
    config = uvicorn.Config(app, host=args.bind, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=int(args.drain_seconds) + GRACE_S)
    try:
        DrainingServer(config, loop, args.drain_seconds).run()
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT once it has shut down gracefully
        return 130
    return 0


def _log_to_stderr(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    logger = logging.getLogger("strata")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    from strata_runtime.cli.engine_flags import add_engine_flags

    parser = argparse.ArgumentParser(prog="python -m strata_runtime.cli.serve",
                                     description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(parser)
    add_engine_flags(parser, host_moved=False)
    args = parser.parse_args(argv)
    try:
        return serve(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"strata serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
