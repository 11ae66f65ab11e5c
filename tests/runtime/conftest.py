from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.engine import Engine


@pytest.fixture(scope="session")
def smol_engine() -> Iterator[Engine]:
    # float32: compared with transformers' fp32 model, within tests/oracle.py's float32 tolerances
    engine = Engine(model="default", max_total_tokens=32768, dtype="float32", log_level="warning")
    yield engine
    report = engine.check_integrity()
    assert report["private"] == 0 and report["protected"] == 0, report
    engine.shutdown()


@pytest.fixture(scope="session")
def smol_hf(smol_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture
def tiny_engine(tiny_model_dir: Path) -> Iterator[Any]:
    """A factory of Engines over the tiny model; every Engine it made is shut down (and checked) after."""
    made: list[Engine] = []

    def make(**options: Any) -> Engine:
        options.setdefault("max_total_tokens", 8192)
        # float32 unless a test asks otherwise: --dtype auto is bfloat16 on some hosts and float32 on others,
        # and these tests compare runs with each other and must mean the same on every host
        options.setdefault("dtype", "float32")
        options.setdefault("log_level", "warning")
        engine = Engine(model=str(tiny_model_dir), **options)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        report = engine.check_integrity()
        assert report["private"] == 0 and report["protected"] == 0, report
        engine.shutdown()
