"""Reading what the router needs out of a worker's answer, without touching the bytes the client gets.

From a JSON body or an SSE stream it collects the prompt and cached token counts (OpenAI ``usage`` with
``prompt_tokens_details.cached_tokens``, or native ``meta_info``) and the text of the first answer (for
cache_aware, which records prompt + answer as what the worker now caches). Stream chunks are fed here
*after* they have been passed on, so observing never delays a byte.
"""

from __future__ import annotations

from typing import Any

import orjson


class ResponseObserver:
    def __init__(self) -> None:
        self.usage: tuple[int, int] | None = None  # OpenAI: (prompt_tokens, cached_tokens)
        self._meta: dict[int, tuple[int, int]] = {}  # native: index -> (prompt, cached) of its latest frame
        self._text: list[str] = []  # first answer, in pieces (OpenAI deltas)
        self._native_text: str | None = None  # first answer, cumulative (native frames)
        self._buf = b""
        self.malformed = False

    # ------------------------------------------------------------------ results
    def tokens(self) -> tuple[int, int] | None:
        """(prompt tokens, cached tokens) summed over the call's sequences, if the answer said."""
        if self.usage is not None:
            return self.usage
        if self._meta:
            return (sum(p for p, _ in self._meta.values()), sum(c for _, c in self._meta.values()))
        return None

    def completion(self) -> str | None:
        if self._native_text is not None:
            return self._native_text
        return "".join(self._text) if self._text else None

    # ------------------------------------------------------------------ feeding
    def feed_json(self, body: bytes) -> None:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            self.malformed = True
            return
        items = obj if isinstance(obj, list) else [obj]
        for i, item in enumerate(items):
            if isinstance(item, dict):
                self._take(item, i, cumulative=True)

    def feed_sse(self, chunk: bytes) -> None:
        buf = self._buf + chunk
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return
        self._buf = buf[end + 2 :]
        for event in buf[:end].split(b"\n\n"):
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if not payload or payload == b"[DONE]":
                    continue
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    self.malformed = True
                    continue
                if isinstance(obj, dict):
                    self._take(obj, obj.get("index", 0) if "choices" not in obj else 0, cumulative=False)

    def _take(self, obj: dict[str, Any], index: Any, cumulative: bool) -> None:
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            self.usage = (usage["prompt_tokens"], cached if isinstance(cached, int) else 0)
        choices = obj.get("choices")
        if isinstance(choices, list):
            for ch in choices:
                if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                    continue
                piece = ch.get("text")
                if piece is None:
                    holder = ch.get("message") if cumulative else ch.get("delta")
                    piece = holder.get("content") if isinstance(holder, dict) else None
                if isinstance(piece, str):
                    self._text.append(piece)
            return
        meta = obj.get("meta_info")
        if isinstance(meta, dict):
            p, c = meta.get("prompt_tokens"), meta.get("cached_tokens")
            if isinstance(p, int) and isinstance(c, int):
                self._meta[index if isinstance(index, int) else 0] = (p, c)
            text = obj.get("text")
            if isinstance(text, str) and index == 0:
                self._native_text = text  # native frames carry the whole text so far
