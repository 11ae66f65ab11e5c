"""Grammar-constrained decoding with xgrammar: validation, cached compilation, per-request matchers.

Four kinds of constraint, one per request: ``json_schema``, ``regex``, ``ebnf`` and ``structural_tag``
(free text with constrained regions, used for tool calls). Validation only parses the grammar (no
tokenizer work, a few ms), so the HTTP layer and the Engine reject a bad one with xgrammar's message
before anything reaches the scheduler. Compilation (token masks, ~100 ms for a JSON schema) happens on
a worker thread — xgrammar releases the GIL while it compiles — and is cached by (kind, text), so the
scheduler keeps decoding other requests meanwhile and a repeated grammar costs nothing.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from runtime.constrained.json_strings import strict_strings
from runtime.core.sampling_params import GRAMMAR_KINDS

CACHE_SIZE = 256
_ENGINE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _clean(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    return _ENGINE_PREFIX.sub("", str(exc)).strip()


def validate_grammar(kind: str, text: str) -> None:
    """Raise ValueError("<kind>: <engine message>") if ``text`` is not a valid grammar of ``kind``."""
    import xgrammar as xgr

    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"{kind}: unknown grammar kind (use one of {', '.join(GRAMMAR_KINDS)})")
    try:
        if kind == "json_schema":
            json.loads(text)
            xgr.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
        else:
            xgr.Grammar.from_structural_tag(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{kind}: not valid JSON: {exc}") from None
    except Exception as exc:  # xgrammar raises RuntimeError / its own errors with a clear message
        raise ValueError(f"{kind}: {_clean(exc)}") from None


class RequestGrammar:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary; thread-safe cache, one compile thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # compilations started (cache misses)
        self.cache_hits = 0  # requests for a grammar already compiled or compiling

    def compile_async(self, kind: str, text: str) -> Future[Any]:
        key = (kind, text)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return fut
            self.compiles += 1
            fut = self._pool.submit(self._compile, kind, text)
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, kind: str, text: str) -> Any:
        c = self.compiler
        try:
            if kind == "json_schema":
                # Compact JSON: whitespace between tokens is fixed, so a sampler can never wander off
                # into endless indentation (valid JSON either way; output is also easier to diff).
                return c.compile_json_schema(json.dumps(strict_strings(json.loads(text))), any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "ebnf":
                return c.compile_grammar(text)
            return c.compile_structural_tag(text)
        except Exception as exc:
            raise ValueError(f"{kind}: {_clean(exc)}") from None

    def matcher(self, compiled: Any) -> RequestGrammar:
        return RequestGrammar(self._xgr.GrammarMatcher(compiled))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarMasker:
    """Applies the grammars of the constrained rows of a batch to its logits (other rows untouched)."""

    def __init__(self, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._bitmask: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, grammars: Sequence[Any]) -> None:
        """``grammars``: one per logits row, None for an unconstrained row."""
        idx = [i for i, g in enumerate(grammars) if g is not None]
        if not idx:
            return
        n = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = self._xgr.allocate_token_bitmask(max(n, 16), self.vocab_size)
        bitmask = self._bitmask[:n]
        for i in idx:
            grammars[i].fill_mask(bitmask, i)
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
                                              indices=idx)
