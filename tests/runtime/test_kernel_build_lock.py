"""Kernel builds and the lock files a killed build leaves behind.

torch's ``cpp_extension`` guards a build directory with a lock file that it deletes when it is done; a process
killed while compiling leaves it, and without ``build_kernels``' own lock every later load of that kernel set
waited on it forever (a server that never starts). Each test loads in a fresh process, so an import cached in
this one proves nothing, and a hang shows as a timeout. The kernel set loaded is a one-line module under the
invariant set's name, built from a folder of its own by ``build_kernels`` (the same lock, baton and compile
path as the real sets): compiling the real invariant kernels took 25-55 s of the suite for nothing the
locks depend on.
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
# A module with nothing in it: torch's build names it (TORCH_EXTENSION_NAME), and it needs pybind11's header only.
MODULE = "#include <pybind11/pybind11.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n"
LOAD = ("import logging, sys; from pathlib import Path; logging.basicConfig(level=logging.INFO)\n"
        "from runtime.kernels.build import build_kernels\n"
        "build_kernels('invariant', Path(sys.argv[1])); print('loaded', flush=True)")
# Holds the kernel set's lock the way a live build does (with torch's lock file present) until told on stdin to
# let go, then reports whether its lock file was left alone while it held the lock. Waiting for the word, not for
# a fixed time, keeps the test true on a slow host, where starting the loader (importing torch) can take seconds.
HOLD = """
import sys
from pathlib import Path
from runtime.build_cache import making
folder = Path(sys.argv[1])
with making(folder / "radixserve.lock", "the invariant kernels"):
    baton = folder / "lock"
    baton.touch()
    print("holding", flush=True)
    sys.stdin.readline()
    print("kept" if baton.exists() else "removed", flush=True)
    baton.unlink()
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root of this module's own: other test files on the other worker, and the servers they start, load
    kernels from the shared root meanwhile, and one of them could take the stale lock file a test planted there
    before the test's own loader found it."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source folder of the kernel set the loaders build (its first load compiles it, a few seconds)."""
    folder = tmp_path_factory.mktemp("sources")
    (folder / "invariant.cpp").write_text(MODULE)
    return folder


@pytest.fixture
def folder(cache: Path, sources: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(cache))  # for build_dir here and the loaders started below
    out = build_dir("invariant", build_key("invariant", sources))
    assert out.is_relative_to(cache)
    out.mkdir(parents=True, exist_ok=True)
    yield out
    (out / "lock").unlink(missing_ok=True)  # never leave a lock behind for the tests after this one


def test_a_load_after_a_killed_build_clears_its_lock(folder: Path, sources: Path) -> None:
    (folder / "lock").touch()  # what a build killed mid-compile leaves
    done = subprocess.run([sys.executable, "-c", LOAD, str(sources)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded" in done.stdout
    assert "left by a build of the invariant kernels that did not finish" in done.stderr
    assert not (folder / "lock").exists()


def test_a_load_waits_for_a_live_build(folder: Path, sources: Path, tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    log = tmp_path / "loader.log"
    loader: subprocess.Popen[str] | None = None
    try:
        assert holder.stdin is not None and holder.stdout is not None
        assert holder.stdout.readline().strip() == "holding"
        with log.open("w") as err:
            loader = subprocess.Popen([sys.executable, "-c", LOAD, str(sources)], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=err, text=True)
        deadline = time.monotonic() + 300
        while "another process is making the invariant kernels" not in log.read_text():
            assert loader.poll() is None, f"the loader went on while the lock was held: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the loader never reported the lock it waits on"
            time.sleep(0.1)
        time.sleep(0.5)
        assert loader.poll() is None  # still waiting: the lock, not a fixed delay, holds it back
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "kept"  # the live build's lock file was not taken for stale
        out, _ = loader.communicate(timeout=300)
        assert loader.returncode == 0, log.read_text()[-2000:]
        assert "loaded" in out
    finally:
        for proc in (holder, loader):
            if proc is not None:
                proc.kill()
                proc.wait()


def test_each_environment_keeps_its_own_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile command names the environment's torch and Python headers by absolute path: two environments
    sharing one build directory would each find the other's command there and recompile on every switch."""
    from runtime.kernels import build

    here = build_key("fastcpu", HERE)
    assert build_key("fastcpu", HERE) == here  # stable in one environment: a second process finds the build
    other = [d.replace("site-packages", "other-env/site-packages") for d in build.include_dirs()]
    monkeypatch.setattr(build, "include_dirs", lambda: other)
    assert build_key("fastcpu", HERE) != here


def test_a_source_folder_names_its_own_translation_units(tmp_path: Path) -> None:
    """A kernel set compiles the units its folder holds, so another revision's copy (bench_kernel_ab.py builds one
    beside this checkout's) builds with its own files, whether it has fewer or more units than this one; a folder
    without any is an error that says so, not an empty build."""
    from runtime.kernels.build import KernelBuildError, source_files

    here = {p.name for p in source_files("fastcpu", HERE)}
    assert {"fastcpu.cpp", "fastcpu_extend.cpp", "fastcpu_pack.cpp"} <= here
    assert "invariant.cpp" not in here
    assert [p.name for p in source_files("invariant", HERE)] == ["invariant.cpp"]
    for name in ("fastcpu.cpp", "fastcpu_extend.cpp", "fastcpu_vec.h", "invariant.cpp"):
        (tmp_path / name).write_text("// a revision's copy\n")
    assert [p.name for p in source_files("fastcpu", tmp_path)] == ["fastcpu.cpp", "fastcpu_extend.cpp"]
    with pytest.raises(KernelBuildError, match="no sources of the fastcpu kernels"):
        source_files("fastcpu", tmp_path / "missing")
