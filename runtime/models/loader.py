"""Read a model folder's config with transformers and load its safetensors into our code.

The folder comes from ``folders.resolve_model_path`` (``folders`` also loads tokenizers). Every failure is a
:class:`ModelLoadError` whose message names the path.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from runtime.attention import make_attention_backend
from runtime.attention.base import AttentionBackend, AttentionShape
from runtime.models.errors import ModelLoadError
from runtime.models.llama import LlamaForCausalLM
from runtime.models.ops import ModelOps
from runtime.models.registry import get_model_class
from runtime.models.tp_plan import TPContext

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"

__all__ = [
    "ModelLoadError",
    "attention_shape",
    "kv_layout",
    "load_config",
    "load_model",
    "safetensors_files",
]


def load_config(path: str | os.PathLike[str]) -> Any:
    """The folder's HF config, checked to name an architecture we implement."""
    from transformers import AutoConfig

    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json (is it a Hugging Face model folder?)")
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # unknown model_type, invalid JSON, ...
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    get_model_class(config)
    return config


def attention_shape(config: Any) -> AttentionShape:
    """Query heads, KV heads and head dim of a config (what an attention backend is built for)."""
    return get_model_class(config).arch_from_config(config).attention_shape


def kv_layout(config: Any) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)``: the shape a KV pool for this model needs."""
    arch = get_model_class(config).arch_from_config(config)
    return arch.num_layers, arch.num_kv_heads, arch.head_dim


def load_model(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu",
               attn_backend: AttentionBackend | None = None,
               ops: ModelOps | None = None, tp: TPContext | None = None) -> tuple[LlamaForCausalLM, Any]:
    """Build our model for the folder's architecture and load its weights; returns ``(model, hf_config)``.

    ``attn_backend`` defaults to ``make_attention_backend("auto", ...)`` for ``device``; ``ops`` to plain torch;
    ``tp`` loads only this tensor-parallel rank's shard of each weight.
    """
    folder = Path(path)
    config = load_config(folder)
    cls = get_model_class(config)
    if attn_backend is None:
        attn_backend = make_attention_backend("auto", attention_shape(config), device, dtype)
    files = safetensors_files(folder)
    for file in files:
        check_safetensors(file)
    model = cls(config, attn_backend, dtype=dtype, device=device, ops=ops, tp=tp)
    model.load_weights(_iter_tensors(files))
    model.eval()
    logger.info("loaded %s (%s, %d layers) from %s as %s on %s", cls.__name__, config.model_type,
                model.arch.num_layers, folder, dtype, device)
    return model, config


def safetensors_files(folder: Path) -> list[Path]:
    """A folder's weight files: the index's shards, else ``model.safetensors``, else ``*.safetensors``."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"invalid safetensors index {index}: {exc}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that do not exist: {missing[:3]}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {folder} has no safetensors weights "
                             "(PyTorch .bin checkpoints are not supported; re-save with safetensors)")
    return files


def check_safetensors(file: Path) -> None:
    """Validate a safetensors file's header against its size before mapping it.

    A truncated file would otherwise fail deep inside a tensor read (or crash on a short mmap)."""
    size = file.stat().st_size
    try:
        with file.open("rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            if size < 8 or header_len <= 0 or 8 + header_len > size:
                raise ValueError("the header length does not fit in the file")
            header = json.loads(fh.read(header_len))
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"corrupt safetensors file {file}: {exc}") from exc
    data_len = size - 8 - header_len
    if max(ends, default=0) != data_len:
        raise ModelLoadError(f"truncated or corrupt safetensors file {file}: its header describes "
                             f"{max(ends, default=0)} bytes of tensors but {data_len} are present")


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    yield name, fh.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as exc:  # SafetensorError and friends
            raise ModelLoadError(f"cannot read safetensors file {file}: {exc}") from exc
