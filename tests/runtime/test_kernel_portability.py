"""The CPU kernel sources compile for CPUs without the instructions of the machine running the tests.

Every kernel set is built with ``-march=native``, so a build on an AVX512_BF16 host never compiles the code that an
AVX2 host gets, where the ``#ifdef``s on AVX-512, VNNI, BF16 and AMX are all off; a name used outside the guard that
declares it breaks the whole kernel set there, and the server on such a host loses every fast kernel. The hosts this
project runs on change between AVX2 and AVX-512 with BF16, so each test run checks the sources for the portable
target too: the compile command of ``runtime/kernels/build.py`` with ``-march=x86-64-v3`` (AVX2 and FMA, no
AVX-512), syntax and templates only (no code generated, ~5 s a file).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from runtime.kernels.build import CFLAGS, HERE, SOURCES, include_dirs, source_files

CXX = shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_kernel_sources_compile_for_an_avx2_cpu(name: str) -> None:
    assert CXX is not None
    flags = [f for f in CFLAGS[name] if not f.startswith("-march=")]
    assert len(flags) == len(CFLAGS[name]) - 1, "the build names one target CPU, which this test replaces"
    command = [CXX, *flags, "-march=x86-64-v3", "-fsyntax-only", f"-DTORCH_EXTENSION_NAME={name}_portable",
               *(f"-I{d}" for d in include_dirs()), *map(str, source_files(name, HERE))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    errors = [line for line in done.stderr.splitlines() if ": error:" in line]
    assert done.returncode == 0, "\n".join(errors[:20]) or done.stderr[-3000:]
