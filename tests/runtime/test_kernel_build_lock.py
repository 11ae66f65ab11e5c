"""Kernel builds and the lock files a killed build leaves behind.

torch's ``cpp_extension`` guards a build directory with a lock file that it deletes when it is done; a process
killed while compiling leaves it, and without ``build_kernels``' own lock every later load of that kernel set
waited on it forever (a server that never starts). Each test loads in a fresh process, so an import cached in
this one proves nothing, and a hang shows as a timeout.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.kernels.build import HERE, build_dir, build_key

ROOT = Path(__file__).resolve().parents[2]
LOAD = ("import logging; logging.basicConfig(level=logging.INFO)\n"
        "from runtime.kernels.build import load_kernels\n"
        "load_kernels('invariant'); print('loaded', flush=True)")
# Holds the kernel set's lock the way a live build does (with torch's lock file present), then reports whether
# its lock file was left alone while it held the lock.
HOLD = """
import sys, time
from pathlib import Path
from runtime.build_cache import making
folder = Path(sys.argv[1])
with making(folder / "radixserve.lock", "the invariant kernels"):
    baton = folder / "lock"
    baton.touch()
    print("holding", flush=True)
    time.sleep(2.0)
    print("kept" if baton.exists() else "removed", flush=True)
    baton.unlink()
"""


@pytest.fixture
def folder() -> Iterator[Path]:
    out = build_dir("invariant", build_key("invariant", HERE))
    out.mkdir(parents=True, exist_ok=True)
    yield out
    (out / "lock").unlink(missing_ok=True)  # never leave a lock behind for the tests after this one


def test_a_load_after_a_killed_build_clears_its_lock(folder: Path) -> None:
    (folder / "lock").touch()  # what a build killed mid-compile leaves
    done = subprocess.run([sys.executable, "-c", LOAD], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded" in done.stdout
    assert "left by a build of the invariant kernels that did not finish" in done.stderr
    assert not (folder / "lock").exists()


def test_a_load_waits_for_a_live_build(folder: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "holding"
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-c", LOAD], cwd=ROOT, capture_output=True, text=True, timeout=300)
        waited = time.monotonic() - t0
        assert done.returncode == 0, done.stderr[-2000:]
        assert "loaded" in done.stdout
        assert "another process is making the invariant kernels" in done.stderr
        assert holder.stdout.readline().strip() == "kept"  # the live build's lock file was not taken for stale
        assert waited > 1.0  # it loaded only once the holder let go
    finally:
        holder.kill()
        holder.wait()
