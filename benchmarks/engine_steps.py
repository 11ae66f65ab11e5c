"""What the Engine benchmarks share: timing decode steps from the scheduler's own step log, and
printing and saving a result."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from typing import Any, TypeVar

from runtime.engine import Engine

T = TypeVar("T")


def decode_step_ms(engine: Engine, batch: int, run: Callable[[], T]) -> tuple[float, T]:
    """Run ``run`` (engine calls) and return the median ms of the scheduler steps it caused that decoded
    exactly ``batch`` rows — the prefill step and the tail where requests finish are left out — with
    what ``run`` returned."""
    engine._control(lambda s: s.stats.decode_steps.clear())
    out = run()
    times = engine._control(lambda s: [t for b, t in s.stats.decode_steps if b == batch])
    return 1000 * statistics.median(times), out


def emit(result: dict[str, Any], path: str | None) -> None:
    """Print ``result`` as JSON, and save it to ``path`` when one is given."""
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)
