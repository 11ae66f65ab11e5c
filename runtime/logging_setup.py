"""One logging format for every process, each line naming the process it came from."""

from __future__ import annotations

import logging


def configure_logging(level: str, process: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s [{process}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    # third-party chatter below warnings is noise in a server log
    for name in ("httpx", "urllib3", "filelock", "transformers"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
