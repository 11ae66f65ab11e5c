"""Fixtures shared by the model tests (helpers live in ``model_helpers``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from model_helpers import TINY_CONFIGS, make_hf_model


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """One saved random checkpoint per architecture: ``arch -> (hf_model, folder)``."""
    out = {}
    for arch in TINY_CONFIGS:
        model = make_hf_model(arch)
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(folder)
        out[arch] = (model, folder)
    return out
