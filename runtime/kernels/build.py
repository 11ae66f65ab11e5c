"""Compile and load a C++ kernel module shipped with the package, once per machine.

The build goes to ``<cache root>/kernels/<name>-<hash of source, torch version, CPU flags and the compile
command>`` (the cache root of ``runtime.build_cache``: ``~/.cache/radixserve`` by default), so a changed source,
another torch, another host CPU or another virtual environment gets its own build, and a second process finds the
finished one.

Concurrent builds of one directory: ``cpp_extension`` serialises them with a lock *file* that it deletes when
it is done, so a process killed mid-compile (Ctrl-C during the first start, a test's timeout) leaves the file
behind and every later load of that kernel set would wait for it forever. Loads therefore go through
``build_cache.making``'s lock first, which dies with its holder: while it is held no other radixserve process is
compiling there, and a torch lock file found then is stale and is removed.

Needs a C++ compiler (``c++``/``g++``) and ninja; without them a :class:`KernelBuildError` says so.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import time
from pathlib import Path
from types import ModuleType

import torch

from runtime.build_cache import cache_root, making
from runtime.config import cpu_flags

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
# -fopenmp: at::parallel_for is a header template over OpenMP pragmas; without it every kernel runs on one
# thread. The library it links (libgomp.so.1) resolves to the copy torch already loaded: one thread pool.
BASE_CFLAGS = ["-O3", "-march=native", "-fno-fast-math", "-std=c++17", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
# Per kernel set. invariant: -ffp-contract=off keeps a*b+c two roundings everywhere (the compiler may not
# fuse some call sites and not others), and without fast-math float sums are never reordered; -march=native
# only picks instructions, not arithmetic. fastcpu: multiply-adds may fuse (FMA), for speed.
CFLAGS = {"invariant": [*BASE_CFLAGS, "-ffp-contract=off"], "fastcpu": [*BASE_CFLAGS, "-ffp-contract=fast"]}
# The translation units of each kernel set, as a file pattern: the files of a source folder say what a build
# compiles, so another revision's folder (bench_kernel_ab.py) builds its own units. Headers beside them are part of
# every set's build key.
SOURCES = {"invariant": "invariant.cpp", "fastcpu": "fastcpu*.cpp"}


class KernelBuildError(RuntimeError):
    """A native kernel module could not be compiled or loaded here."""


def _ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the ninja wheel's binary may sit beside this Python only."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the PyPI wheel

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass


def _stage(sources: list[Path], headers: list[Path], folder: Path) -> list[Path]:
    """Copies of ``sources`` (and the headers beside them) in ``folder``, the build directory's own: ninja records
    the paths it compiled, so building from the package's files would rebuild whenever the same sources are
    loaded from another checkout or install location (a clone for CI, a second worktree), though the key is
    the same. Files are replaced atomically and only when their content differs."""
    folder.mkdir(parents=True, exist_ok=True)
    for src in [*sources, *headers]:
        dst = folder / src.name
        data = src.read_bytes()
        if not dst.exists() or dst.read_bytes() != data:
            tmp = folder / f".{src.name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, dst)
    return [folder / src.name for src in sources]


@functools.cache
def load_kernels(name: str) -> ModuleType:
    """Build (if needed) and import the kernel set ``name`` (``SOURCES``) as a Python module (once per process)."""
    return build_kernels(name, HERE)


def include_dirs() -> list[str]:
    """The header folders the compile command names: torch's and Python's. They are absolute paths into one
    environment, so two virtual environments with the same torch write different commands into a shared build
    directory, and ninja, seeing the command change, recompiles everything (~80 s) on each switch."""
    from torch.utils import cpp_extension

    return [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]


def source_files(name: str, source_dir: Path) -> list[Path]:
    """The translation units of kernel set ``name`` in ``source_dir``."""
    files = sorted(source_dir.glob(SOURCES[name]))
    if not files:
        raise KernelBuildError(f"no sources of the {name} kernels in {source_dir}")
    return files


def build_key(name: str, source_dir: Path) -> str:
    """The build key of kernel set ``name`` from the sources in ``source_dir`` on this host, torch and
    environment (its include folders: each environment keeps its own build)."""
    sources = source_files(name, source_dir)
    headers = sorted(source_dir.glob("*.h"))
    text = b"".join(p.read_bytes() for p in [*sources, *headers])
    host = " ".join(sorted(cpu_flags())) or platform.processor()
    command = " ".join(CFLAGS[name] + LDFLAGS + include_dirs())
    return hashlib.sha256(text + torch.__version__.encode() + host.encode() + command.encode()).hexdigest()[:16]


def build_dir(name: str, key: str) -> Path:
    """Where the build of kernel set ``name`` with key ``key`` lives."""
    return cache_root() / "kernels" / f"{name}-{key}"


def build_kernels(name: str, source_dir: Path) -> ModuleType:
    """Build (if needed) and import the kernel set ``name`` from the sources in ``source_dir``: this package's
    (``load_kernels``), or another revision's, which ``benchmarks/bench_kernel_ab.py`` loads beside these to
    time both in one process. Builds are keyed by their sources, so the two never overwrite each other."""
    key = build_key(name, source_dir)
    folder = build_dir(name, key)
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise KernelBuildError(f"building the {name} kernels needs a C++ compiler (c++/g++ on PATH; on "
                               "Debian/Ubuntu: apt-get install g++)")
    _ninja_on_path()
    with making(folder / "radixserve.lock", f"the {name} kernels"):
        baton = folder / "lock"  # cpp_extension's; nobody else is building here now, so it is a dead build's
        if baton.exists():
            logger.warning("removing %s, left by a build of the %s kernels that did not finish", baton, name)
            baton.unlink(missing_ok=True)
        return _compile_and_load(name, key, source_dir, folder)


def _compile_and_load(name: str, key: str, source_dir: Path, folder: Path) -> ModuleType:
    from torch.utils import cpp_extension

    headers = sorted(source_dir.glob("*.h"))
    sources = _stage(source_files(name, source_dir), headers, folder / "src")
    flags = CFLAGS[name]
    fresh = not any(folder.glob("*.so"))
    t0 = time.perf_counter()
    if fresh:
        logger.info("compiling the %s CPU kernels (once per machine, ~1 min) into %s", name, folder)
    try:
        # Copies of the flag lists: load() appends torch's library paths to extra_ldflags in place, which put the
        # first build's venv path into the key of every kernel set loaded after it in the same process (another
        # build directory, compiled again: ~70 s inside a deterministic server's first step).
        module = cpp_extension.load(name=f"radixserve_{name}_{key}", sources=[str(p) for p in sources],
                                    extra_cflags=list(flags), extra_ldflags=list(LDFLAGS),
                                    build_directory=str(folder), verbose=False)
    except Exception as exc:  # compiler errors, a missing ninja, a failed import of the built library
        raise KernelBuildError(f"could not build the {name} kernels: {exc}") from exc
    if fresh:
        logger.info("compiled the %s kernels in %.1fs", name, time.perf_counter() - t0)
    return module


@functools.cache
def optional_kernels(name: str) -> ModuleType | None:
    """``load_kernels(name)``, or None where they cannot be built here (said once, in a warning): for callers
    with a plain torch way to the same result."""
    try:
        return load_kernels(name)
    except KernelBuildError as exc:
        logger.warning("%s; the plain torch path runs instead", exc)
        return None


def build_all() -> None:
    """Build every kernel set now (set-up time), so neither the first server start nor the first test pays for
    the compile; without a compiler this only warns (the server then says what it cannot do without one)."""
    for name in SOURCES:
        try:
            load_kernels(name)
        except KernelBuildError as exc:
            logger.warning("%s", exc)


def target_errors(name: str, march: str, source_dir: Path = HERE) -> list[str]:
    """The compiler's errors for kernel set ``name`` built for ``-march=<march>`` instead of this host (syntax and
    templates only: no code is generated), with the build's own flags; empty when it compiles. Builds target
    ``-march=native``, so a host with AVX512_BF16 never compiles the code an AVX2 host gets, where every ``#ifdef``
    on AVX-512, VNNI, BF16 and AMX is off: a name used outside the section that declares it broke the whole
    fastcpu set on such hosts once, unseen for days. CI checks the sources for an AVX2 target this way."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        raise KernelBuildError("checking the kernels for another CPU needs a C++ compiler (c++/g++ on PATH)")
    flags = [f for f in CFLAGS[name] if not f.startswith("-march=")]
    command = [compiler, *flags, f"-march={march}", "-fsyntax-only", f"-DTORCH_EXTENSION_NAME={name}_check",
               *(f"-I{d}" for d in include_dirs()), *map(str, source_files(name, source_dir))]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 0:
        return []
    return [line for line in done.stderr.splitlines() if ": error:" in line] or [done.stderr[-3000:]]


def main() -> None:
    parser = argparse.ArgumentParser(description="Build every CPU kernel set for this host (set-up time), or check "
                                     "that their sources compile for another CPU.")
    parser.add_argument("--check-march", metavar="TARGET", help="instead of building, compile every set's sources "
                        "for gcc's -march=TARGET (e.g. x86-64-v3: AVX2 without AVX-512) without generating code, "
                        "and exit 1 with the errors if one does not compile")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check_march is None:
        build_all()
        return
    failed = False
    for name in SOURCES:
        errors = target_errors(name, args.check_march)
        logger.info("the %s kernels for -march=%s: %s", name, args.check_march, "compile" if not errors else "FAIL")
        for line in errors[:40]:
            logger.error("%s", line)
        failed = failed or bool(errors)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
