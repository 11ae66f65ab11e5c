"""Tokenizer helpers shared by the TokenizerManager, the Engine and the router: prompt ids, end-of-sequence ids and
chat templates."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """A prompt's token ids, as every API's intake makes them (special tokens as the tokenizer adds them)."""
    return encode(tokenizer, text, add_special_tokens=True)


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """``tokenizer(text, add_special_tokens=...).input_ids`` as a list.

    A fast (Rust-backed) tokenizer is asked through its backend's ``encode_batch_fast`` when the backend is set as
    transformers sets it for such a call (no truncation, no padding, special tokens split or not as the tokenizer
    says; transformers itself then calls the backend's ``encode_batch`` with the same arguments): the same ids
    without the offsets and the ``BatchEncoding`` around them, 0.8 ms instead of 1.15 for a 1,065-token prompt. The
    HTTP process tokenises every prompt on the cores the forward pass runs on. Anything else takes transformers'
    own call (which also resets a backend's truncation or padding, so later calls come here)."""
    if asks_backend(tokenizer):
        return list(tokenizer.backend_tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def asks_backend(tokenizer: Any) -> bool:
    """Whether :func:`encode` asks ``tokenizer``'s Rust backend directly now (see there)."""
    backend: Any = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    return (hasattr(backend, "encode_batch_fast") and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)))


def eos_token_ids(tokenizer: Any, hf_config: Any, model_path: str | Path) -> frozenset[int]:
    """Every id that ends generation: the tokenizer's EOS, the config's and generation_config.json's."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(tokenizer, "eos_token_id", None))
    add(getattr(hf_config, "eos_token_id", None))
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        with contextlib.suppress(OSError, ValueError):
            add(json.loads(gen.read_text()).get("eos_token_id"))
    return frozenset(ids)


def load_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"chat_template: file {file} does not exist")
    return file.read_text()


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], *, template: str | None = None,
                        tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, **kwargs: Any) -> list[int]:
    """Render ``messages`` with the model's chat template and tokenize them (no extra special tokens)."""
    if getattr(tokenizer, "chat_template", None) is None and template is None:
        raise ValueError("messages: this model has no chat template; use /v1/completions or /generate")
    rendered = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message, **kwargs,
    )
    return encode(tokenizer, rendered, add_special_tokens=False)
