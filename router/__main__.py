"""``python -m router --worker-urls URL ...``: the router without the ``radixserve`` command (same flags)."""

from __future__ import annotations

import argparse
import sys

from router.cli import run_router
from router.config import add_router_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router", description="radixserve's router over several "
                                     "workers (see `radixserve router --help`).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_router_args(parser)
    return run_router(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
