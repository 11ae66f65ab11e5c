"""What radixserve makes once per machine and keeps (converted models, compiled kernels): where it lives, and the
lock under which one process makes a thing while the others wait for it and then use it.

The lock is an ``fcntl`` lock on a file beside the thing. The kernel drops it when its holder exits, however it
exits, so a process killed half-way never leaves the others waiting: whoever takes the lock next finds the
half-made thing and may clear it away (``convert_gguf`` removes leftover temporary folders, ``build_kernels``
torch's own lock file).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """``$RADIXSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/radixserve``, else ``~/.cache/radixserve``."""
    explicit = os.environ.get("RADIXSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "radixserve"


@contextlib.contextmanager
def making(lock_path: Path, what: str) -> Iterator[None]:
    """Hold the lock at ``lock_path`` (created if missing) while making ``what``; if another process holds it,
    say so and wait for it."""
    with lock_path.open("a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is making %s; waiting for it (%s)", what, lock_path)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
