"""Import SGLang's own frontend (``sglang.lang``) from the installed ``sglang`` package, without its server.

``import sglang`` runs ``sglang/__init__.py``, which first applies server-side patches from ``sglang.srt``
(``sglang.srt.utils`` imports torch, triton and the server's own helpers: triton alone is a 286 MB wheel).
The frontend needs none of that: ``sglang.lang`` imports only ``sglang.utils`` (pybase64, IPython, requests,
numpy, pydantic, tqdm) and ``sglang.srt.environ``. So this loads the package object without running its
``__init__``, then runs that same ``__init__`` minus its statements that use ``sglang.srt`` (the patches; the
``Engine`` and ``ServerArgs`` lazy imports stay lazy), giving the exact public names of ``import sglang``.

Two helpers of SGLang's server package that ``sglang.test.test_programs`` imports for its own checks are stood
in for: ``sglang.srt.utils.is_hip`` (is this a ROCm build: False) and
``sglang.srt.utils.hf_transformers_utils.get_tokenizer`` (the model's tokenizer, through transformers).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path


def _get_tokenizer(model_path: str, **kwargs: object) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _load() -> types.ModuleType:
    spec = importlib.util.find_spec("sglang")  # locates the package; runs nothing
    if spec is None or spec.origin is None or spec.submodule_search_locations is None:
        raise ImportError("the sglang package is not installed (pip install sglang --no-deps)")
    init = Path(spec.origin)
    pkg = types.ModuleType("sglang")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__file__ = str(init)
    pkg.__spec__ = spec
    pkg.__package__ = "sglang"
    sys.modules["sglang"] = pkg

    utils = types.ModuleType("sglang.srt.utils")
    utils.is_hip = lambda: False  # type: ignore[attr-defined]
    sys.modules["sglang.srt.utils"] = utils
    hf_utils = types.ModuleType("sglang.srt.utils.hf_transformers_utils")
    hf_utils.get_tokenizer = _get_tokenizer  # type: ignore[attr-defined]
    sys.modules["sglang.srt.utils.hf_transformers_utils"] = hf_utils

    tree = ast.parse(init.read_text(), str(init))
    server_names: set[str] = set()
    kept: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang.srt"):
            server_names.update(alias.asname or alias.name for alias in node.names)
            continue
        if any(isinstance(n, ast.Name) and n.id in server_names for n in ast.walk(node)):
            continue
        kept.append(node)
    exec(compile(ast.Module(body=kept, type_ignores=[]), str(init), "exec"), pkg.__dict__)
    return pkg


@contextlib.contextmanager
def sglang_frontend() -> Iterator[types.ModuleType]:
    """``sglang`` (frontend only) in ``sys.modules`` for the duration; whatever was there before is put back,
    so tests that alias ``sglang`` to another package are not disturbed."""
    before = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    for k in before:
        del sys.modules[k]
    try:
        yield _load()
    finally:
        for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            del sys.modules[k]
        sys.modules.update(before)


def load_test_programs() -> types.ModuleType:
    """``sglang.test.test_programs`` (call inside ``sglang_frontend()``)."""
    return importlib.import_module("sglang.test.test_programs")
