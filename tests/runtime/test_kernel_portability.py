"""``build.target_errors``: the check CI runs on the kernel sources for an AVX2 CPU (``python -m
runtime.kernels.build --check-march x86-64-v3`` in .ci/run, ~2.5 min for torch's headers), tried here on a source
folder small enough to compile in a second. It must report a name used outside the ``#ifdef`` section that
declares it, which compiles on this host only when the section is on, and pass the same file once it is fixed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from runtime.kernels.build import target_errors

SOURCE = """
#ifdef __AVX512F__
namespace wide { typedef float v16 __attribute__((vector_size(64))); }
using namespace wide;
#endif
int lanes() { %s x = {}; return sizeof(x) / sizeof(float) + (int)x[0]; }
"""


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_a_name_from_a_section_an_avx2_cpu_lacks_is_reported(tmp_path: Path) -> None:
    (tmp_path / "fastcpu.cpp").write_text(SOURCE % "v16")
    assert target_errors("fastcpu", "skylake-avx512", tmp_path) == []  # the section is on: it compiles
    errors = target_errors("fastcpu", "x86-64-v3", tmp_path)
    assert errors and all("fastcpu.cpp" in e for e in errors) and any("v16" in e for e in errors)
    (tmp_path / "fastcpu.cpp").write_text(SOURCE % "float __attribute__((vector_size(64)))")
    assert target_errors("fastcpu", "x86-64-v3", tmp_path) == []
