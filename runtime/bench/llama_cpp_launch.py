"""``python -m runtime.bench.llama_cpp_launch ARGS``: llama-cpp-python's OpenAI server (``python -m
llama_cpp.server ARGS``), runnable on hosts where its AMX weight repacking crashes.

llama-cpp-python 0.3.36 loses its process (SIGSEGV) on the first completion on CPUs with AMX: the weights go
to ggml's AMX buffer type and its repacked kernels fault. On such a CPU the model is loaded with
``use_extra_bufts = false`` (llama.cpp's own switch for weight-repacking buffer types), so llama.cpp runs its
regular AVX-512 kernels; the benchmark report says so. Elsewhere nothing is changed.
"""

from __future__ import annotations

import runpy
from typing import Any

from runtime.config import cpu_flags

AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16"})


def repacking_crashes() -> bool:
    return bool(cpu_flags() & AMX_FLAGS)


def _without_extra_buffer_types() -> None:
    import llama_cpp.llama as llama_module

    lib = llama_module.llama_cpp
    default_params = lib.llama_model_default_params

    def params() -> Any:
        p = default_params()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params


def main() -> None:
    if repacking_crashes():
        _without_extra_buffer_types()
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
