"""The ``radixserve`` command: ``serve`` (one server, or ``--dp N`` workers behind a router), ``router``,
``bench``, ``top``."""

from __future__ import annotations

import argparse
import sys

from router.cli import add_dp_args, add_router_parser
from runtime.bench.cli import add_bench_parser, run_bench
from runtime.cli_top import add_top_parser
from runtime.config import add_server_args, server_args_from_namespace


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="radixserve: LLM serving with a radix-tree "
                                     "KV cache (SGLang-native and OpenAI-compatible HTTP APIs).")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="Serve a model over HTTP.",
                           description="Serve a model over HTTP (SGLang-native and OpenAI-compatible APIs). "
                           "The port opens once the model is loaded.",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_server_args(serve)
    add_dp_args(serve)
    add_router_parser(sub)
    add_bench_parser(sub)
    add_top_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from runtime.launch import launch_server

        try:
            server_args = server_args_from_namespace(args)
            server_args.validate()
        except ValueError as exc:
            print(f"radixserve serve: {exc}", file=sys.stderr)
            sys.exit(2)
        if args.dp > 1:
            from router.cli import run_dp

            sys.exit(run_dp(args, server_args))
        sys.exit(launch_server(server_args))
    if args.command == "router":
        from router.cli import run_router

        sys.exit(run_router(args))
    elif args.command == "bench":
        sys.exit(run_bench(args, sys.argv[1:] if argv is None else argv))
    elif args.command == "top":
        from runtime.cli_top import run_top

        sys.exit(run_top(args))


if __name__ == "__main__":
    main()
