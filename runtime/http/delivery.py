"""Running one HTTP call's requests: submit them, then wait for them or stream them as server-sent events.

Every generation route goes through the same three steps: ``submit_all`` (all requests checked before any
is sent: one bad request, or a queue without room for all, rejects the whole call), then either ``wait``
(every final state, or None when the client went away) or ``open_stream`` + ``stream_response`` (the first
update awaited before any byte is sent, so a request refused at once still gets its HTTP status). A client
that goes away, at any point, aborts whatever is unfinished. What the frames say is the route's business:
it hands ``stream_response`` its own async iterator of frames.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from runtime.http.errors import APIError, error_body, raise_if_rejected
from runtime.request.intake import SingleRequest
from runtime.request.state import RequestState
from runtime.server.tokenizer_manager import ReqHandle, ServerUnavailable, TokenizerManager

DONE = b"data: [DONE]\n\n"
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but the log says what happened
Update = tuple[int, RequestState]  # (index of the request in the call, its state)


class ClientDisconnected(Exception):
    pass


def sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def client_closed() -> Response:
    """The answer to a client that has gone (its requests were aborted)."""
    return Response(status_code=CLIENT_CLOSED)


# ---------------------------------------------------------------------- submit
async def submit_all(tm: TokenizerManager, singles: Sequence[SingleRequest], bounded: bool = True) -> list[ReqHandle]:
    """Validate every request first (the intake's checks: an IntakeError names the field), then send them; a
    bad one rejects the whole call (nothing runs), and so does a waiting queue without room for all (429;
    ``bounded`` False: a health probe, which the queue bound does not apply to)."""
    tm.front.admit(singles, bounded)
    handles: list[ReqHandle] = []
    try:
        for s in singles:
            handles.append(await tm.submit(s))
    except BaseException:
        await abort_unfinished(tm, handles, "another request of the same call was rejected")
        raise
    return handles


async def abort_unfinished(tm: TokenizerManager, handles: Sequence[ReqHandle], why: str) -> None:
    for h in handles:
        if not h.done:
            await tm.abort(h.rid, why)


# ---------------------------------------------------------------------- wait
async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: asyncio.Future[Any]) -> Any:
    """``work``'s result, or ClientDisconnected (``work`` cancelled) if the client leaves first."""
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher


async def wait_all(tm: TokenizerManager, request: Request, handles: Sequence[ReqHandle]) -> list[RequestState]:
    """Every handle's final state; if the client goes away first, abort them all (ClientDisconnected)."""
    try:
        return list(await _unless_gone(request, asyncio.ensure_future(
            asyncio.gather(*(h.result() for h in handles)))))
    except ClientDisconnected:
        await abort_unfinished(tm, handles, "the client disconnected")
        raise


async def wait(request: Request, tm: TokenizerManager, handles: Sequence[ReqHandle]) -> list[RequestState] | None:
    """The final states of an OpenAI-shaped call (None: the client left, its requests are aborted). A
    request that ended in an error abort (a timeout, say) makes the whole call that error."""
    try:
        states = await wait_all(tm, request, handles)
    except ClientDisconnected:
        return None
    for st in states:
        raise_if_rejected(st)
    return states


# ---------------------------------------------------------------------- stream
async def merged_updates(handles: Sequence[ReqHandle]) -> AsyncIterator[Update]:
    """(index, state) each time one of the handles changes, until all have finished."""
    queue: asyncio.Queue[tuple[int, RequestState | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, h: ReqHandle) -> None:
        try:
            async for state in h.updates():
                await queue.put((i, state))
        except BaseException as exc:  # handed to the consumer
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class Updates:
    """The updates of a call's requests, the first one already received (``first``)."""

    def __init__(self, first: Update, rest: AsyncIterator[Update]):
        self.first = first
        self._rest = rest

    async def __aiter__(self) -> AsyncIterator[Update]:
        yield self.first
        async for item in self._rest:
            yield item

    async def close(self) -> None:
        await _close(self._rest)


async def _close(it: AsyncIterator[Any]) -> None:
    """Close an unfinished async generator (its clean-up runs now, not whenever it is collected)."""
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()


async def _next(updates: AsyncIterator[Update]) -> Update:
    return await anext(updates)


async def open_stream(request: Request, tm: TokenizerManager, handles: list[ReqHandle]) -> Updates | None:
    """Wait for the first update before any byte is sent. None: the client left (everything aborted); an
    APIError: the runtime rejected the first request to answer (the others aborted)."""
    rest = merged_updates(handles)  # an async generator: aclose() stops its pumps now
    try:
        first: Update = await _unless_gone(request, asyncio.ensure_future(_next(rest)))
        raise_if_rejected(first[1])
    except ClientDisconnected:
        await _close(rest)
        await abort_unfinished(tm, handles, "the client disconnected")
        return None
    except APIError:
        await _close(rest)
        await abort_unfinished(tm, handles, "another choice of the request was rejected")
        raise
    return Updates(first, rest)


def openai_error_frame(exc: APIError) -> bytes:
    return sse(error_body(exc.status, exc.message, exc.param, exc.code))


def stream_response(tm: TokenizerManager, handles: Sequence[ReqHandle], updates: Updates,
                    frames: AsyncIterator[bytes], error_frame: Callable[[APIError], bytes] = openai_error_frame,
                    done: bytes | None = DONE) -> StreamingResponse:
    """Send ``frames`` (built by the route from ``updates``) as an SSE stream. After the first frame only a
    frame can say what went wrong: a rejected request or a lost server becomes ``error_frame``. However the
    stream ends, what is unfinished is aborted (the client left, or an error ended it)."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for frame in frames:
                yield frame
        except APIError as exc:
            yield error_frame(exc)
        except ServerUnavailable as exc:
            yield error_frame(APIError(503, f"the server is unavailable: {exc}"))
        finally:
            await _close(frames)
            await updates.close()
            await abort_unfinished(tm, handles, "the client disconnected")
        if done is not None:
            yield done

    return StreamingResponse(body(), media_type="text/event-stream")
