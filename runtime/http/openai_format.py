"""OpenAI's response objects as pure functions of what was generated: ids, usage, finish reasons, logprobs
(chat and legacy shapes), the envelope every object of one response shares, and chat's assistant message
and stream deltas from what the output parser split out.

Nothing here waits, sends or decides what happens next: the routes (``completions``, ``chat``) do, and call
these to say how each object looks.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from runtime.core.sampling_params import SamplingParams
from runtime.parsers.output import Parsed
from runtime.request.state import RequestState

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


# ---------------------------------------------------------------------- chat's assistant message
def chat_message(parsed: Parsed, reasoning_field: bool) -> dict[str, Any]:
    """The whole assistant message; ``reasoning_field``: the server splits reasoning out (the field is
    there, null when the model gave none)."""
    calls = [c.to_openai() for c in parsed.calls]
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content or (None if calls else ""),
                           "refusal": None}
    if calls:
        msg["tool_calls"] = calls
    if reasoning_field:
        msg["reasoning_content"] = parsed.reasoning or None
    return msg


def chat_delta(parsed: Parsed, first_call: int) -> dict[str, Any]:
    """A stream delta; its tool calls are numbered from ``first_call`` (the calls the choice sent before)."""
    delta: dict[str, Any] = {}
    if parsed.reasoning:
        delta["reasoning_content"] = parsed.reasoning
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.calls:
        delta["tool_calls"] = [c.to_openai(first_call + i) for i, c in enumerate(parsed.calls)]
    return delta


def chat_finish_reason(state: RequestState, calls: int) -> str:
    """A choice that stopped after calling tools finished for "tool_calls"."""
    reason = finish_reason(state) or "stop"
    return "tool_calls" if calls and reason == "stop" else reason
