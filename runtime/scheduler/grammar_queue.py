"""Requests waiting for their grammar: compiled on xgrammar's worker thread while the scheduler keeps stepping.

A request with a grammar (JSON schema, regex, EBNF, structural tag) cannot be scheduled until its grammar is
compiled, which can take from microseconds (a cached grammar) to seconds (a large schema). Compiling on the
scheduler's thread would stall every running request, so it happens on the backend's worker thread, and the
scheduler collects finished compilations before it schedules each step. While only compilations are pending
the scheduler's loop polls briefly instead of blocking (``SchedulerLoop``: ``Scheduler.compiling``).
The backend is built on first use: most servers never see a grammar.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from runtime.constrained.grammar import GrammarBackend, GrammarMasker
from runtime.executor.sampler import Sampler
from runtime.scheduler.req import Req


class GrammarQueue:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int], sampler: Sampler):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = eos_ids
        self._sampler = sampler
        self._backend: GrammarBackend | None = None
        self._pending: list[tuple[Req, Future[Any]]] = []

    @property
    def backend(self) -> GrammarBackend | None:
        """The compiler (with its cache of compiled grammars); None until the first grammar arrives."""
        return self._backend

    def _compiler(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = GrammarBackend(self._tokenizer, self._vocab_size, sorted(self._eos_ids))
            self._sampler.grammar_masker = GrammarMasker(self._vocab_size)
        return self._backend

    def add(self, req: Req) -> None:
        """Start compiling ``req``'s grammar (it must have one)."""
        assert req.sampling.grammar is not None
        self._pending.append((req, self._compiler().compile_async(*req.sampling.grammar)))

    def collect(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """The requests whose compilation ended: those ready to wait (their matcher set) and those whose
        grammar the compiler refused, with its message."""
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        still = []
        for req, fut in self._pending:
            if not fut.done():
                still.append((req, fut))
                continue
            exc = fut.exception()
            if exc is not None:
                failed.append((req, str(exc)))
                continue
            req.grammar = self._compiler().matcher(fut.result())
            ready.append(req)
        self._pending = still
        return ready, failed

    def remove(self, rid: str) -> Req | None:
        """Take ``rid`` out of the queue (an abort); its compilation finishes unused (the cache keeps it)."""
        for req, _ in self._pending:
            if req.rid == rid:
                self._pending = [(r, f) for r, f in self._pending if r is not req]
                return req
        return None

    def __len__(self) -> int:
        return len(self._pending)
