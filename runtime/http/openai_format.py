"""OpenAI responses: usage, logprobs (chat and legacy shapes), assistant messages, and delivery.

``respond`` waits for a call's choices (one JSON object) or streams them (SSE chunks ending in
``data: [DONE]``); the endpoints in ``openai_api`` only say how a whole response (``build``) and one
choice's chunk (``chunk``) look. A client that goes away aborts whatever is unfinished.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from runtime.core.sampling_params import SamplingParams
from runtime.http.errors import APIError, abort_status, error_body
from runtime.http.requests import DONE, ClientDisconnected, abort_unfinished, merged_updates, sse, wait_all
from runtime.request.state import RequestState
from runtime.server.tokenizer_manager import ReqHandle, ServerUnavailable, TokenizerManager

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens


def new_id(prefix: str, rid: str | None = None) -> str:
    return f"{prefix}-{rid or uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(states: list[RequestState], n: int) -> dict[str, Any]:
    """Usage of one call: ``states`` are prompt-major (``n`` samples per prompt). Each prompt counts once,
    with the cached tokens of its first sample (later samples reuse the first one's prefill)."""
    firsts = states[::n]
    prompt = sum(s.prompt_tokens for s in firsts)
    completion = sum(s.completion_tokens for s in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(sum(s.cached_tokens for s in firsts))},
    }


def finish_reason(state: RequestState) -> str | None:
    """OpenAI's finish reason; a plain abort (no error status) ends the choice like a stop."""
    fin = state.finished
    if fin is None:
        return None
    return "length" if fin.type == "length" else "stop"


def visible_output_len(state: RequestState, sampling: SamplingParams) -> int:
    """How many output tokens the client sees logprobs for: all but a trimmed stop token (EOS...)."""
    n = len(state.output_logprobs)
    fin = state.finished
    if (fin is not None and fin.type == "stop" and isinstance(fin.matched, int) and not sampling.no_stop_trim
            and n and state.output_logprobs[-1][1] == fin.matched):
        return n - 1
    return n


class TokenText:
    """Token id -> (text, UTF-8 bytes) for logprobs, cached. Byte-level BPE pieces are mapped back to
    their exact bytes (so a token holding half of a multi-byte character reports its true bytes)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        self.byte_decoder: dict[str, int] | None = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and "ByteLevel" in repr(backend.decoder):
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self.byte_decoder = {c: b for b, c in bytes_to_unicode().items()}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        hit = self.cache.get(tid)
        if hit is None:
            hit = self.cache[tid] = self._compute(tid)
        return hit

    def text(self, tid: int) -> str:
        return self(tid)[0]

    def _compute(self, tid: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.convert_ids_to_tokens(tid)
        m = _BYTE_PIECE.fullmatch(piece) if isinstance(piece, str) else None
        dec = self.byte_decoder
        if dec is not None and isinstance(piece, str) and all(c in dec for c in piece):
            raw = bytes(dec[c] for c in piece)
        elif m is not None:
            raw = bytes([int(m.group(1), 16)])
        else:
            text = self.tokenizer.decode([tid])
            return text, list(text.encode())
        return raw.decode("utf-8", errors="replace"), list(raw)


# ---------------------------------------------------------------------- logprobs
def chat_logprobs(entries: list[tuple[float, int]], tops: list[list[tuple[float, int]]], k: int,
                  tt: TokenText) -> dict[str, Any]:
    """``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    content = []
    for i, (lp, tid) in enumerate(entries):
        text, raw = tt(tid)
        top = tops[i][:k] if k and i < len(tops) else []
        content.append({
            "token": text, "logprob": lp, "bytes": raw,
            "top_logprobs": [{"token": tt(t)[0], "logprob": tlp, "bytes": tt(t)[1]} for tlp, t in top],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[tuple[float | None, int]], tops: list[Any], k: int, tt: TokenText,
                        offset: int = 0) -> dict[str, Any]:
    """The legacy shape: tokens, token_logprobs, top_logprobs (token -> logprob, the chosen token
    included), text_offset (each token's start in the choice's text, counting from ``offset``)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for i, (lp, tid) in enumerate(entries):
        text = tt.text(tid)
        tokens.append(text)
        token_logprobs.append(lp)
        offsets.append(offset)
        offset += len(text)
        top = tops[i] if i < len(tops) else None
        if lp is None:
            top_logprobs.append(None)
            continue
        alts = {tt.text(t): tlp for tlp, t in (top or [])[:k]}
        alts.setdefault(text, lp)
        top_logprobs.append(alts)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


# ---------------------------------------------------------------------- the assistant's message
class AssistantOutput:
    """How one choice's generated text becomes the assistant message (``message``) or stream deltas
    (``delta`` for each new piece of text, ``finish_delta`` once at the end), and its finish reason.

    This one passes the text through. A tool-call parser subclasses it: it may hold text back in
    ``delta``, return ``tool_calls`` from ``message`` / ``finish_delta``, and answer "tool_calls" from
    ``finish_reason``. One instance per choice; ``openai_api.assistant_output`` picks the class.
    """

    def message(self, text: str) -> dict[str, Any]:
        return {"role": "assistant", "content": text, "refusal": None}

    def delta(self, new_text: str) -> dict[str, Any]:
        return {"content": new_text} if new_text else {}

    def finish_delta(self) -> dict[str, Any]:
        return {}

    def finish_reason(self, reason: str) -> str:
        return reason


# ---------------------------------------------------------------------- objects
class Envelope:
    """The fields every object of one response shares (id, created, model)."""

    def __init__(self, obj_id: str, model: str, include_usage: bool = False):
        self.id = obj_id
        self.model = model
        self.created = now()
        self.include_usage = include_usage

    def wrap(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                               "system_fingerprint": None, "choices": choices}
        out.update(extra)
        return out

    def chunk(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A stream chunk; with include_usage every chunk but the last has ``usage: null``."""
        return self.wrap(obj, choices, usage=None) if self.include_usage else self.wrap(obj, choices)

    def usage_chunk(self, obj: str, use: dict[str, Any]) -> dict[str, Any]:
        return self.wrap(obj, [], usage=use)


def merge_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two stream deltas as one: contents concatenated, tool-call lists joined, other fields from ``b``."""
    out = dict(a)
    for key, value in b.items():
        joinable = key in ("content", "tool_calls") and isinstance(value, (str, list))
        if joinable and isinstance(out.get(key), type(value)):
            out[key] = out[key] + value
        else:
            out[key] = value
    return out


def pad(items: list[Any], n: int) -> list[Any]:
    """``items`` cut or padded with None to length ``n``."""
    return items[:n] + [None] * (n - len(items))


# ---------------------------------------------------------------------- delivery
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but the log says what happened
Update = tuple[int, RequestState]


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def first_update(request: Request, updates: AsyncIterator[Update]) -> Update:
    """The first update of a stream, before any byte is sent: a request the runtime rejects at once
    still gets a proper error status. A client gone meanwhile raises ClientDisconnected."""

    async def step() -> Update:
        return await updates.__anext__()

    nxt = asyncio.ensure_future(step())
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if nxt in done:
            return nxt.result()
        nxt.cancel()
        with contextlib.suppress(BaseException):
            await nxt
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher


async def close(updates: AsyncIterator[Update]) -> None:
    """Close an unfinished stream of updates (its pump tasks stop)."""
    aclose = getattr(updates, "aclose", None)
    if aclose is not None:
        await aclose()


def raise_if_rejected(state: RequestState) -> None:
    """Raise the APIError of a request that ended in an error abort (a timeout, say): the intake has
    refused every request it can name a field of, so these name none."""
    status = abort_status(state.finished)
    if status is not None:
        raise APIError(status, (state.finished and state.finished.message) or "the request was rejected")


@dataclass
class ChoiceStream:
    """What one choice has sent so far."""

    sent: int = 0  # characters of the cumulative text
    lp_sent: int = 0  # output logprob entries
    in_sent: int = 0  # prompt logprob entries (echo)
    offset: int = 0  # legacy text_offset of the next token
    started: bool = False
    done: bool = False
    post: AssistantOutput = field(default_factory=AssistantOutput)

    def new_text(self, state: RequestState) -> str:
        new = state.text[self.sent:]
        self.sent = max(self.sent, len(state.text))
        return new


async def respond(request: Request, tm: TokenizerManager, handles: list[ReqHandle], stream: bool,
                  build: Callable[[list[RequestState]], Any], chunk: Callable[[int, RequestState], Any],
                  env: Envelope, obj: str, n: int) -> Response:
    """Wait for or stream the choices. ``build(states)`` makes the whole response, ``chunk(i, state)``
    the choice object of one stream chunk (None: nothing new to send)."""
    if not stream:
        try:
            states = await wait_all(tm, request, handles)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        for st in states:
            raise_if_rejected(st)
        return json_response(build(states))
    updates = merged_updates(handles)
    try:
        first = await first_update(request, updates)
        raise_if_rejected(first[1])
    except ClientDisconnected:
        await close(updates)
        await abort_unfinished(tm, handles, "the client disconnected")
        return Response(status_code=CLIENT_CLOSED)
    except APIError:
        await close(updates)
        await abort_unfinished(tm, handles, "another choice of the request was rejected")
        raise

    async def frames() -> AsyncIterator[bytes]:
        try:
            item: Update | None = first
            while item is not None:
                choice = chunk(*item)
                if choice is not None:
                    yield sse(env.chunk(obj, [choice]))
                item = await anext(updates, None)
            if env.include_usage:
                yield sse(env.usage_chunk(obj, usage([h.state for h in handles], n)))
        except APIError as exc:  # after the first chunk only an error event can say it
            yield sse(error_body(exc.status, exc.message, exc.param))
        except ServerUnavailable as exc:
            yield sse(error_body(503, f"the server is unavailable: {exc}"))
        finally:
            await close(updates)
            await abort_unfinished(tm, handles, "the client disconnected")
        yield DONE

    return StreamingResponse(frames(), media_type="text/event-stream")
