"""The ``radixserve`` command: ``serve`` (one server), and the other tools as they land."""

from __future__ import annotations

import argparse
import sys

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
        sys.exit(launch_server(server_args))


if __name__ == "__main__":
    main()
