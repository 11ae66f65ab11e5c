"""RequestView: what the policies need to know of one request, read once from its JSON body.

The body itself is forwarded unchanged (the router never re-serialises it); this only extracts the
prompt (``text`` / ``input_ids`` of /generate, ``prompt`` of /v1/completions, ``messages`` + ``tools`` of
/v1/chat/completions) and the cache namespace (``cache_salt``). A batch (a list of prompts) is routed as
one request, by its first prompt: every prompt of the call goes to the same worker.

``text_key()`` is the key of cache_aware's text trees: an 8-byte tag naming the kind of prompt and the
namespace (so chat, text and token-id prompts, and different salts, never match each other), then the
prompt as bytes. Chat messages are serialised append-only (``role \\x1f content \\x1e`` per message), so the
key of a conversation is a prefix of the key of its next turn, like the rendered template would be.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Any

import orjson

GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
TAG_BYTES = 8


def namespace_tag(kind: bytes, namespace: str | None) -> bytes:
    ns = b"" if namespace is None else namespace.encode()
    return kind + hashlib.blake2b(ns, digest_size=TAG_BYTES - 1).digest()


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") if isinstance(p, dict) and p.get("type") == "text"
                       else orjson.dumps(p).decode() for p in content)
    return "" if content is None else orjson.dumps(content).decode()


def serialize_messages(messages: list[Any]) -> bytes:
    out = bytearray()
    for m in messages:
        if not isinstance(m, dict):
            continue
        out += str(m.get("role", "")).encode() + b"\x1f" + _content_text(m.get("content")).encode()
        if m.get("tool_calls"):
            out += orjson.dumps(m["tool_calls"])
        out += b"\x1e"
    return bytes(out)


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


@dataclass
class RequestView:
    path: str
    body: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    namespace: str | None = None
    text: str | None = None  # the (first) prompt text
    input_ids: list[int] | None = None  # the (first) prompt's token ids, when the client sent ids
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    _text_key: bytes | None = None
    tokens: list[int] | None = None  # filled in by the router's tokenizer when a policy needs ids
    key: bytes | None = None  # the policy's lookup key, computed once by ``Policy.prepare``

    @classmethod
    def parse(cls, path: str, body: Any) -> RequestView:
        """Never raises: a body the router cannot read is still forwarded, and the worker explains."""
        view = cls(path)
        if not isinstance(body, dict):
            return view
        view.body = body
        view.stream = body.get("stream") is True
        salt = body.get("cache_salt")
        if isinstance(salt, list) and salt:
            salt = salt[0]
        view.namespace = salt if isinstance(salt, str) else None
        if path == CHAT:
            msgs = body.get("messages")
            if isinstance(msgs, list):
                view.messages = [m for m in msgs if isinstance(m, dict)]
            tools = body.get("tools")
            view.tools = tools if isinstance(tools, list) and tools else None
            return view
        prompt = body.get("text") if path == GENERATE else body.get("prompt")
        ids = body.get("input_ids") if path == GENERATE else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: routed by its first prompt
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            ids = ids[0]
        if isinstance(prompt, str):
            view.text = prompt
        elif _is_ids(prompt):
            view.input_ids = prompt
        elif _is_ids(ids):
            view.input_ids = ids
        return view

    @property
    def routable(self) -> bool:
        return self.text is not None or self.input_ids is not None or self.messages is not None

    # ------------------------------------------------------------------ text keys
    def text_key(self) -> tuple[bytes, int]:
        """(key, tag length): the text-tree key; match lengths count from after the tag."""
        if self._text_key is None:
            self._text_key = self._build_text_key(None)
        return self._text_key, TAG_BYTES

    def text_key_with_completion(self, completion: str) -> bytes:
        """The key of this prompt followed by the model's answer (what the worker has cached after it)."""
        return self._build_text_key(completion)

    def _build_text_key(self, completion: str | None) -> bytes:
        if self.messages is not None:
            payload = (orjson.dumps(self.tools) if self.tools else b"") + serialize_messages(self.messages)
            if completion is not None:
                payload += serialize_messages([{"role": "assistant", "content": completion}])
            return namespace_tag(b"C", self.namespace) + payload
        if self.input_ids is not None:
            # Token ids cannot be extended by text; the answer is added only for text prompts.
            return namespace_tag(b"I", self.namespace) + array("i", self.input_ids).tobytes()
        text = (self.text or "") + (completion or "")
        return namespace_tag(b"T", self.namespace) + text.encode()
