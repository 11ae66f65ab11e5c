"""Running a set of requests for one HTTP call: submit, wait (aborting on disconnect), merge streams."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from fastapi import Request

from runtime.request.intake import SingleRequest
from runtime.request.state import RequestState
from runtime.server.tokenizer_manager import ReqHandle, TokenizerManager

DONE = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    pass


def sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def submit_all(tm: TokenizerManager, singles: Sequence[SingleRequest]) -> list[ReqHandle]:
    """Validate every request first (the intake's checks: an IntakeError names the field), then send them; a
    bad one rejects the whole call (nothing runs), and so does a waiting queue without room for all (429)."""
    tm.check_capacity(len(singles))
    for s in singles:
        tm.prepare(s)
    handles: list[ReqHandle] = []
    try:
        for s in singles:
            handles.append(await tm.submit(s, checked=True))
    except BaseException:
        await abort_unfinished(tm, handles, "another request of the same call was rejected")
        raise
    return handles


async def abort_unfinished(tm: TokenizerManager, handles: Sequence[ReqHandle], why: str) -> None:
    for h in handles:
        if not h.done:
            await tm.abort(h.rid, why)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def wait_all(tm: TokenizerManager, request: Request, handles: Sequence[ReqHandle]) -> list[RequestState]:
    """Wait for every handle to finish; if the client goes away first, abort them all."""
    waiter: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*(h.result() for h in handles)))
    watcher: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if waiter in done:
            return list(waiter.result())
        waiter.cancel()
        await abort_unfinished(tm, handles, "the client disconnected")
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher


async def merged_updates(handles: Sequence[ReqHandle]) -> AsyncIterator[tuple[int, RequestState]]:
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
