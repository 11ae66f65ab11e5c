"""Access to the shared benchmark workloads (few-shot, multi-turn chat, parallel sampling, agent loop).

The generators live in the benchmark suite shared with the peers' measurements (``workloads.py`` of the
suite folder), so every system is measured on the same requests. The folder is ``$RADIXSERVE_BENCH_DIR``
or ``../shared/bench`` beside the repository.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def bench_dir() -> Path:
    return Path(os.environ.get("RADIXSERVE_BENCH_DIR", REPO.parent / "shared" / "bench"))


@lru_cache(maxsize=1)
def load_workloads() -> ModuleType:
    path = bench_dir() / "workloads.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"the benchmark workloads are not at {path}; set RADIXSERVE_BENCH_DIR to the folder holding "
            "workloads.py")
    spec = importlib.util.spec_from_file_location("radixserve_shared_workloads", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
