"""Fixtures shared by the runtime, server, frontend and router tests.

``tiny_model_dir``: a random-weight Llama small enough to run hundreds of requests in seconds, with the
default model's tokenizer and chat template (so text, chat and stop strings behave like the real model).
``smol_dir``: the converted default model (SmolLM2-135M-Instruct), converted once per machine.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs two workers on as few as two cores, each with its servers and engines on two OpenMP threads. Threads
# that spin while they wait for work (OpenMP's default) then take the cores from the threads that have work: a test
# of 6.5 s alone took 113 s beside the other worker, and the whole suite 16:42-17:58. Waiting threads that sleep
# (before torch loads libgomp, and inherited by every server the tests start) made it 10:05 on the same host.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _server_logs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Server and router logs of this session in one folder under pytest's base temp (pruned to the last three
    sessions by pytest) instead of loose files in $TMPDIR."""
    from tests.server_harness import use_log_dir

    use_log_dir(tmp_path_factory.mktemp("server-logs"))


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    from runtime.models.folders import resolve_model_path

    return resolve_model_path("default")


@contextmanager
def checked_engine(model: str | Path, **options: Any) -> Iterator[Any]:
    """An in-process Engine that must end with no KV held by requests (the accounting invariant)."""
    from runtime.engine import Engine

    eng = Engine(model=str(model), log_level="warning", **options)
    try:
        yield eng
        report = eng.check_integrity()
        assert report["private"] == 0 and report["protected"] == 0, report
    finally:
        eng.shutdown()


def make_tiny_model(folder: Path, tokenizer_src: Path, seed: int = 0, layers: int = 2,
                    hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=2, initializer_range=0.5,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_src / name).exists():
            shutil.copy(tokenizer_src / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smol_dir)
