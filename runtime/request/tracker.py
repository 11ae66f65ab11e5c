"""The caller's side of requests in flight: one handle per request, and the registry that routes outputs to them.

The server's tokenizer manager and the in-process ``Engine`` keep their requests the same way: a handle is
registered under its rid when the request is sent (a rid in use is refused), each output the scheduler
sends for it is applied to its ``RequestState`` with the text so far, and it leaves the registry with its
final output. When the scheduler is gone, every handle still registered is failed at once and new ones are
refused. How a handle wakes its waiter differs (an asyncio event in the server, a queue for an Engine
caller's thread), so that part belongs to the subclasses.

The text comes from a ``DecodeStream``: in the server the detokenizer process runs it (its own process, so
the main process's event loop never decodes), and an Engine request decodes on its caller's thread
(``DecodingHandle``), off the scheduler's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from runtime.core.errors import IntakeError
from runtime.core.messages import ReqOutput
from runtime.request.decode_stream import DecodeStream
from runtime.request.intake import SingleRequest
from runtime.request.state import RequestState


class RequestHandle:
    """One request sent and its state as its outputs arrive."""

    def __init__(self, single: SingleRequest):
        self.single = single
        self.state = RequestState(single.rid)

    @property
    def rid(self) -> str:
        return self.single.rid

    @property
    def stream(self) -> bool:
        return self.single.options.stream

    def apply(self, out: ReqOutput, text: str) -> None:
        """One output of the scheduler's and the request's cumulative text after it."""
        self.state.update(out, text)


class DecodingHandle(RequestHandle):
    """A handle that detokenizes its outputs itself (what the server's detokenizer process does for it)."""

    def __init__(self, single: SingleRequest, tokenizer: Any):
        super().__init__(single)
        self.decoder = DecodeStream(tokenizer, single.sampling)

    def apply_output(self, out: ReqOutput) -> None:
        self.apply(out, self.decoder.add(out.new_token_ids, out.finished))


H = TypeVar("H", bound=RequestHandle)


class RequestTracker(Generic[H]):
    """The handles of requests sent and not finished, by rid. Thread-safe: an Engine registers handles on its
    callers' threads while its scheduler thread routes outputs."""

    def __init__(self) -> None:
        self._handles: dict[str, H] = {}
        self._lock = threading.Lock()
        self._closed: BaseException | None = None

    def check_free(self, rid: str) -> None:
        if rid in self._handles:
            raise IntakeError("rid", f"request id {rid!r} is already in use")

    def add(self, handle: H) -> None:
        """Register a handle before its request is sent; raises IntakeError for a rid in use, and the
        ``close`` error once the scheduler is gone."""
        with self._lock:
            if self._closed is not None:
                raise self._closed
            self.check_free(handle.rid)
            self._handles[handle.rid] = handle

    def route(self, out: ReqOutput) -> H | None:
        """The handle ``out`` belongs to (None: unknown, e.g. already failed); a finished request's handle
        leaves the registry."""
        with self._lock:
            if out.finished is not None:
                return self._handles.pop(out.rid, None)
            return self._handles.get(out.rid)

    def close(self, error: BaseException) -> list[H]:
        """The scheduler is gone: remove and return every handle; ``add`` raises ``error`` from now on."""
        with self._lock:
            self._closed = error
            handles = list(self._handles.values())
            self._handles.clear()
        return handles

    def __contains__(self, rid: object) -> bool:
        return rid in self._handles

    def __len__(self) -> int:
        return len(self._handles)

    def __iter__(self) -> Iterator[H]:
        with self._lock:
            return iter(list(self._handles.values()))
