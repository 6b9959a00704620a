"""`strata serve`'s flags, apart from the server so that every other subcommand of the CLI
runs without the web stack installed (the GPU machine's environment, for one)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

DESCRIPTION = ("An OpenAI-compatible HTTP server on the continuous-batching scheduler: "
               "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics. "
               "See strata_runtime.server.")


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
    """`strata_runtime.server.serve`, imported only when the server is asked for."""
    from strata_runtime import server

    return server.serve(args)
