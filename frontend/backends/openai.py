"""OpenAI: any OpenAI-compatible server (``/v1/completions``, ``/v1/chat/completions``) over httpx.

Two modes, as in SGLang:

- completion (``is_chat_model=False``): the program's text, rendered with the chat template, is the
  ``prompt``; ``gen`` works anywhere and ``select`` scores each choice from echoed prompt logprobs
  (``echo: true, logprobs``), falling back to the first token's top logprobs.
- chat (default): the program's finished messages are sent; ``gen``/``select`` must come right after
  ``assistant_begin``. ``select`` compares the choices against the first token's top logprobs.

Features a server lacks end in a FeatureNotSupported naming the feature and the server's message.
``regex``, ``top_k`` and ``min_p`` go out as SGLang's extension fields (radixserve, SGLang and vLLM take
them); ``json_schema`` as ``response_format`` in chat mode and as the ``json_schema`` extension for
completions. A server that silently ignores an extension yields unconstrained text (a typed ``gen``
then raises DtypeError).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from frontend.backends.base import BackendError, BaseBackend, FeatureNotSupported, GenResult
from frontend.backends.http import error_message, post_sse
from frontend.chat import ChatTemplate, resolve_chat_template
from frontend.choices import ChoicesDecision, ChoicesSamplingMethod, mean_logprob
from frontend.ir import GenParams

if TYPE_CHECKING:
    from frontend.interpreter import StreamExecutor

logger = logging.getLogger(__name__)
RETRY_STATUS = (429, 500, 502, 503, 504)
TOP_LOGPROBS_CHAT = 20  # the chat API's limit
TOP_LOGPROBS_COMPLETION = 5  # the legacy completions API's limit


@dataclass
class TokenUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def reset(self) -> None:
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0


class OpenAI(BaseBackend):
    def __init__(self, model_name: str | None = None, base_url: str | None = None, api_key: str | None = None,
                 is_chat_model: bool = True, chat_template: ChatTemplate | str | None = None,
                 timeout: float | None = 600.0, max_retries: int = 2, model: str | None = None,
                 http_client: httpx.Client | None = None):
        """``base_url`` like ``http://host:30000/v1`` (default $OPENAI_BASE_URL, then api.openai.com).

        Without a model name, the server's first ``/models`` entry is used. In completion mode the chat
        template is, unless given, the one a radixserve/SGLang server reports, else ChatML.
        ``http_client`` replaces the default httpx client (proxies, custom transports in tests).
        """
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1").rstrip("/")
        key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self._client = http_client or httpx.Client(
            timeout=httpx.Timeout(timeout, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self._client.headers["Authorization"] = f"Bearer {key}"
        self.max_retries = max_retries
        self.is_chat_model = is_chat_model
        self.token_usage = TokenUsage()
        self._usage_lock = threading.Lock()
        self.model_name = model_name or model or self._first_model()
        self.chat_template = resolve_chat_template(chat_template, None if chat_template else self._server_template())

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        for attempt in range(self.max_retries + 1):
            try:
                resp = self._client.request(method, self.base_url + path,
                                            content=orjson.dumps(payload) if payload is not None else None,
                                            headers={"Content-Type": "application/json"})
            except httpx.TransportError as exc:
                if attempt == self.max_retries:
                    raise BackendError(f"{method} {path}: {exc}") from exc
            else:
                if resp.status_code == 200:
                    return orjson.loads(resp.content)
                if resp.status_code not in RETRY_STATUS or attempt == self.max_retries:
                    raise BackendError(f"{method} {path}: {error_message(resp)}", resp.status_code)
            time.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable")

    def _stream(self, path: str, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        return post_sse(self._client, self.base_url, path, payload)

    def _first_model(self) -> str:
        models = self._request("GET", "/models").get("data") or []
        if not models:
            raise BackendError(f"{self.base_url}/models lists no model; pass model_name=")
        return str(models[0]["id"])

    def _server_template(self) -> str | None:
        """The Jinja template a radixserve/SGLang server reports next to its /v1 API, if it does."""
        root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        try:
            resp = self._client.get(root + "/get_model_info", timeout=5.0)
            return orjson.loads(resp.content).get("chat_template") if resp.status_code == 200 else None
        except (httpx.HTTPError, orjson.JSONDecodeError, AttributeError):
            return None

    # ------------------------------------------------------------------ request bodies
    def _body(self, s: StreamExecutor, params: GenParams, what: str) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.model_name, "max_tokens": params.max_new_tokens,
                                "temperature": params.temperature, "top_p": params.top_p}
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(params, name):
                body[name] = getattr(params, name)
        if params.stop_list:
            body["stop"] = params.stop_list
        # Extensions most OpenAI-compatible servers (radixserve, SGLang, vLLM) take; sent only when used.
        if params.top_k not in (None, -1):
            body["top_k"] = params.top_k
        if params.min_p:
            body["min_p"] = params.min_p
        if params.regex is not None:
            body["regex"] = params.regex
        if params.stop_regex_list:
            body["stop_regex"] = params.stop_regex_list
        if params.n is not None and params.n != 1:
            body["n"] = params.n
        if self.is_chat_model:
            self._check_chat_position(s, what)
            if params.json_schema is not None:  # the standard structured-output field of the chat API
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": orjson.loads(params.json_schema)}}
            return "/chat/completions", {**body, "messages": s.messages_}
        if params.json_schema is not None:  # completions have no standard field: SGLang's extension
            body["json_schema"] = params.json_schema
        return "/completions", {**body, "prompt": s.text_}

    def _check_chat_position(self, s: StreamExecutor, what: str) -> None:
        if s.cur_role != "assistant" or s.text_[s.cur_role_begin_pos or 0:]:
            raise FeatureNotSupported(
                f"{what}: with a chat model the call must come right after assistant_begin() (the chat API "
                "cannot continue partial text); use OpenAI(..., is_chat_model=False) for completions")

    def _unsupported(self, exc: BackendError, params: GenParams) -> BackendError:
        used = [f for f in ("regex", "json_schema") if getattr(params, f) is not None]
        used += ["stop_regex"] if params.stop_regex_list else []
        if exc.status == 400 and used:
            return FeatureNotSupported(f"{'/'.join(used)}: the server at {self.base_url} rejected the request: {exc}",
                                       exc.status)
        return exc

    def _meta(self, reply: dict[str, Any], finish_reason: Any) -> dict[str, Any]:
        usage = reply.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        with self._usage_lock:
            self.token_usage.prompt_tokens += usage.get("prompt_tokens", 0) or 0
            self.token_usage.completion_tokens += usage.get("completion_tokens", 0) or 0
            self.token_usage.cached_tokens += cached
        return {"id": reply.get("id"), "finish_reason": finish_reason,
                "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
                "cached_tokens": cached}

    # ------------------------------------------------------------------ generation
    def get_model_name(self) -> str:
        return self.model_name

    def generate(self, s: StreamExecutor, params: GenParams) -> GenResult:
        path, body = self._body(s, params, "gen")
        try:
            reply = self._request("POST", path, body)
        except BackendError as exc:
            raise self._unsupported(exc, params) from exc
        choices = sorted(reply["choices"], key=lambda c: c.get("index", 0))
        texts = [str((c["message"].get("content") or "") if self.is_chat_model else c.get("text", ""))
                 for c in choices]
        meta = self._meta(reply, choices[0].get("finish_reason"))
        if "n" in body:  # one text per sample; the usage is the whole request's
            return texts, [{**meta, "finish_reason": c.get("finish_reason")} for c in choices]
        return texts[0], meta

    def generate_stream(self, s: StreamExecutor, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        path, body = self._body(s, params, "gen")
        body.update(stream=True, stream_options={"include_usage": True})
        meta: dict[str, Any] = {}
        finish = None
        try:
            for chunk in self._stream(path, body):
                for choice in chunk.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                    delta = (choice.get("delta") or {}).get("content") if self.is_chat_model else choice.get("text")
                    if delta:
                        yield str(delta), meta
                if chunk.get("usage"):
                    meta = self._meta(chunk, finish)
        except BackendError as exc:
            raise self._unsupported(exc, params) from exc
        if not meta:
            meta = {"finish_reason": finish}
        yield "", meta

    def select(self, s: StreamExecutor, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        if choices_method.requires_unconditional_logprobs:
            raise FeatureNotSupported("select: unconditional_likelihood_normalized needs token ids, which the "
                                      "OpenAI API does not return; use token_length_normalized")
        if not self.is_chat_model:
            scored = self._echo_logprobs(s.text_, choices)
            if scored is not None:
                normalized = [mean_logprob(e) for e in scored]
                return choices_method(choices=choices, normalized_prompt_logprobs=normalized,
                                      input_token_logprobs=scored, output_token_logprobs=[[] for _ in choices])
        return self._first_token_select(s, choices)

    def _echo_logprobs(self, prompt: str, choices: list[str]) -> list[list[list[Any]]] | None:
        """Per choice, [logprob, None, token] entries from the boundary token on; None if not echoed."""
        body = {"model": self.model_name, "prompt": [prompt + c for c in choices], "max_tokens": 0,
                "temperature": 0, "echo": True, "logprobs": 1}
        try:
            reply = self._request("POST", "/completions", body)
        except BackendError as exc:
            if exc.status == 400:  # no echo support: the caller falls back
                return None
            raise
        out: list[list[list[Any]]] = []
        for choice, full in zip(sorted(reply.get("choices", []), key=lambda c: c.get("index", 0)),
                                [prompt + c for c in choices]):
            lp = choice.get("logprobs") or {}
            tokens, values, offsets = lp.get("tokens"), lp.get("token_logprobs"), lp.get("text_offset")
            if not tokens or values is None or offsets is None:
                return None
            # Tokens of this prompt only (not the generated one), from the token that holds the boundary.
            rows = [(off, tok, val) for tok, val, off in zip(tokens, values, offsets) if off < len(full)]
            start = max((i for i, r in enumerate(rows) if r[0] < len(prompt)), default=0)
            out.append([[val, None, tok] for off, tok, val in rows[start:]])
        return out if len(out) == len(choices) else None

    def _first_token_select(self, s: StreamExecutor, choices: list[str]) -> ChoicesDecision:
        """Score each choice by the logprob of a top next token that starts it (first-token decision)."""
        if self.is_chat_model:
            self._check_chat_position(s, "select")
            path = "/chat/completions"
            body: dict[str, Any] = {"model": self.model_name, "messages": s.messages_, "max_tokens": 1,
                                    "temperature": 0, "logprobs": True, "top_logprobs": TOP_LOGPROBS_CHAT}
        else:
            path = "/completions"
            body = {"model": self.model_name, "prompt": s.text_, "max_tokens": 1, "temperature": 0,
                    "logprobs": TOP_LOGPROBS_COMPLETION}
        try:
            reply = self._request("POST", path, body)
        except BackendError as exc:
            raise FeatureNotSupported(f"select: the server at {self.base_url} gives no logprobs: {exc}") from exc
        top = _top_logprobs(reply["choices"][0].get("logprobs"))
        if not top:
            raise FeatureNotSupported(f"select: the server at {self.base_url} returned no logprobs")
        scores = []
        for c in choices:
            matches = [lp for tok, lp in top.items() if tok and (c.startswith(tok) or (bool(c) and tok.startswith(c)))]
            scores.append(max(matches) if matches else float("-inf"))
        best = max(range(len(choices)), key=lambda i: (scores[i], -i))
        if scores[best] == float("-inf"):
            logger.warning("select: no choice starts with one of the %d most likely next tokens; picking the "
                           "first choice", len(top))
        return ChoicesDecision(choices[best], {"first_token_scores": scores, "top_logprobs": top})

    def shutdown(self) -> None:
        self._client.close()


def _top_logprobs(logprobs: Any) -> dict[str, float]:
    """{token text: logprob} of the first generated token, from either API's logprobs shape."""
    if not logprobs:
        return {}
    if isinstance(logprobs.get("content"), list) and logprobs["content"]:  # chat
        first = logprobs["content"][0]
        top = {t["token"]: t["logprob"] for t in first.get("top_logprobs") or []}
        top.setdefault(first["token"], first["logprob"])
        return top
    tops = logprobs.get("top_logprobs")  # completions
    if isinstance(tops, list) and tops and isinstance(tops[0], dict):
        return {str(k): float(v) for k, v in tops[0].items()}
    return {}
