"""CLI glue for ``radixserve router`` and ``radixserve serve --dp N`` (wired in ``runtime/cli.py``).

    sub = parser.add_subparsers(...)
    add_router_parser(sub)                 # radixserve router --worker-urls URL ...
    add_dp_args(serve_parser)              # serve: --dp N and --router-<option> flags
    ...
    if args.command == "router": sys.exit(run_router(args))
    if args.command == "serve" and args.dp > 1: sys.exit(run_dp(args, server_args))
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from router.config import STANDALONE_ONLY, add_router_args, router_args_from_namespace

DP_PREFIX = "router-"


def add_router_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``router`` subcommand to ``subparsers`` (from ``parser.add_subparsers()``)."""
    parser = subparsers.add_parser(
        "router", help="Route requests over several workers (cache-aware load balancing).",
        description="An HTTP front for several radixserve workers with the same API as one worker "
        "(SGLang-native and OpenAI). Workers can also be added and removed at run time: POST/DELETE "
        "/workers {\"url\": ...}. Exact mode needs the workers started with --kv-events-port and the "
        "tokenizer on this machine (--tokenizer for remote workers).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_router_args(parser)
    return parser


def run_router(ns: argparse.Namespace) -> int:
    """Run ``radixserve router`` from its parsed flags; returns the exit status."""
    from router.app import serve_router

    try:
        args = router_args_from_namespace(ns)
        args.validate()
    except ValueError as exc:
        print(f"radixserve router: {exc}", file=sys.stderr)
        return 2
    return serve_router(args)


def add_dp_args(serve_parser: argparse.ArgumentParser) -> None:
    """Add ``--dp N`` and the router's options (as ``--router-<option>``) to the ``serve`` parser."""
    group = serve_parser.add_argument_group(
        "data parallelism", "With --dp N > 1, serve starts N workers on the first N free ports after PORT "
        "(PORT+1..PORT+N unless one is taken) and a router on PORT; these options configure that router.")
    group.add_argument("--dp", type=int, default=1, help="Number of workers (data-parallel replicas) to start "
                       "behind a router on this machine.")
    add_router_args(group, prefix=DP_PREFIX, exclude=STANDALONE_ONLY)


def run_dp(ns: argparse.Namespace, server_args: Any) -> int:
    """Run ``radixserve serve --dp N`` (``server_args``: the validated ServerArgs of the workers)."""
    from router.launch_dp import launch_dp

    try:
        router_args = router_args_from_namespace(ns, DP_PREFIX, host=server_args.host, port=server_args.port)
        router_args.validate()
    except ValueError as exc:
        print(f"radixserve serve: {exc}", file=sys.stderr)
        return 2
    return launch_dp(server_args, int(ns.dp), router_args)
