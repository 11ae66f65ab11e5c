"""What the Engine and kernel benchmarks share: timing decode steps from the scheduler's own step log, the median
time of repeated calls, naming the CPU's vector instruction sets, and printing and saving a result."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

from runtime.engine import Engine

T = TypeVar("T")


def decode_step_ms(engine: Engine, batch: int, run: Callable[[], T]) -> tuple[float, T]:
    """Run ``run`` (engine calls) and return the median ms of the scheduler steps it caused that decoded
    exactly ``batch`` rows — the prefill step and the tail where requests finish are left out — with
    what ``run`` returned."""
    engine.inspect(lambda s: s.stats.decode_steps.clear())
    out = run()
    times = engine.inspect(lambda s: [t for b, t in s.stats.decode_steps if b == batch])
    return 1000 * statistics.median(times), out


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """The median ms of ``repeats`` calls of ``fn``, after ``warmup`` calls that are not timed."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def cpu_simd() -> str:
    """The vector instruction sets of this CPU that decide the kernels' speed, for a benchmark's record."""
    from runtime.config import cpu_flags

    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags())


def emit(result: dict[str, Any], path: str | None) -> None:
    """Print ``result`` as JSON, and save it to ``path`` when one is given."""
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)
