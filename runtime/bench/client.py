"""An asyncio load client for any OpenAI-compatible server, driving the workloads of ``workloads.py``.

Every request streams (``stream: true`` with ``stream_options.include_usage``), so the time to the first
token is observable and the usage block (prompt, completion and cached tokens) still arrives at the end.
Independent requests are all submitted at once and a semaphore keeps ``concurrency`` in flight; a
session's steps run in order, each appending the model's answer to the history before the next step, as
a chat client or an agent would (so the server sees the history it produced itself).

``n > 1`` goes to the server in one request (``n_mode="native"``), or as ``n`` requests with ``n = 1`` and
consecutive seeds (``"expand"``) for servers that ignore ``n``. Times are seconds since the run started,
measured once the request holds a concurrency slot: client-side queueing is not the server's latency.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

WARMUP_BODY = {"prompt": "Warm-up request, not measured.", "max_tokens": 4, "temperature": 0.0}


@dataclass
class RequestRecord:
    """One HTTP request (all choices of an ``n > 1`` request together)."""

    id: str
    endpoint: str  # "completions" | "chat"
    body: dict[str, Any]  # as sent, without model/stream (chat: the full history)
    n: int = 1
    sent_at: float = 0.0
    first_token_at: float | None = None
    done_at: float | None = None
    texts: dict[int, str] = field(default_factory=dict)
    chunks: int = 0  # non-empty content chunks (about one token each; one per choice unstreamed): the fallback count
    output_tokens: int | None = None  # usage.completion_tokens
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_at is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def latency(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.sent_at

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "endpoint": self.endpoint, "n": self.n, "sent_at": round(self.sent_at, 4),
                "ttft_s": self.ttft, "latency_s": self.latency, "output_tokens": self.output_tokens,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "chunks": self.chunks,
                "choices": len(self.texts), "error": self.error}


@dataclass
class RunResult:
    """One workload run against one target."""

    workload: str
    params: dict[str, Any]
    description: str
    target: str
    records: list[RequestRecord]
    wall_s: float
    server_before: dict[str, Any] | None = None  # radixserve's /get_server_info around the run
    server_after: dict[str, Any] | None = None


def take_error_or_usage(body: dict[str, Any], rec: RequestRecord) -> bool:
    """A reply's or a stream chunk's error into ``rec`` (True: it was one), or its usage figures."""
    if body.get("error") and not body.get("choices"):
        rec.error = str(body["error"])[:200]
        return True
    usage = body.get("usage")
    if usage:
        rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
        rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    return False


def openai_base(url: str) -> str:
    """``http://host:port`` or ``.../v1`` -> ``.../v1`` (the OpenAI base URL)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def server_root(url: str) -> str:
    base = openai_base(url)
    return base[: -len("/v1")]


def count_http_requests(wl: dict[str, Any], n_mode: str) -> int:
    if wl["kind"] == "sessions":
        return sum(len(s["steps"]) for s in wl["sessions"])
    if n_mode == "expand":
        return sum(max(int(r["body"].get("n", 1) or 1), 1) for r in wl["requests"])
    return len(wl["requests"])


class OpenAIClient:
    def __init__(self, base_url: str, *, concurrency: int = 8, n_mode: str = "native", timeout: float = 1800.0,
                 model: str | None = None, api_key: str = "none", progress: bool = True, label: str = "",
                 stream: bool = True):
        if n_mode not in ("native", "expand"):
            raise ValueError(f"n_mode: native or expand, got {n_mode!r}")
        # Streamed requests time their first token. Unstreamed ones get one JSON reply each (no TTFT): the
        # server then sends nothing per token, which shows what streaming costs it.
        self.stream = stream
        self.base = openai_base(base_url)
        self.root = server_root(base_url)
        self.model = model
        self.concurrency = concurrency
        self.n_mode = n_mode
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.progress = progress
        self.label = label
        self.records: list[RequestRecord] = []
        self._session: aiohttp.ClientSession | None = None
        self._sem = asyncio.Semaphore(concurrency)
        self._bar: Any = None
        self._t0 = time.perf_counter()

    async def __aenter__(self) -> OpenAIClient:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            # a fresh connection per request: llama.cpp's HTTP server drops kept-alive connections after a
            # streamed reply and aiohttp then fails on reuse; the cost (one local TCP connect) is negligible
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
        )
        if self.model is None:
            try:
                self.model = await self._first_model()
            except BaseException:  # __aexit__ does not run when __aenter__ fails
                await self._session.close()
                raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use the client as an async context manager"
        return self._session

    async def _first_model(self) -> str:
        """The first id of GET /models; also the check that the server is there at all."""
        try:
            async with self.session.get(self.base + "/models", headers=self.headers) as resp:
                data = await resp.json(content_type=None)
                return str(data["data"][0]["id"])
        except aiohttp.ClientConnectionError as exc:
            raise ConnectionError(f"cannot reach {self.base}: {exc}") from exc
        except (aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError, asyncio.TimeoutError):
            return "default"

    # ------------------------------------------------------------------ radixserve's native API (optional)
    async def server_info(self) -> dict[str, Any] | None:
        """``/get_server_info``'s cache and scheduler figures, or None for servers without it."""
        try:
            async with self.session.get(self.root + "/get_server_info") as resp:
                if resp.status != 200:
                    return None
                data = await resp.json()
        except (aiohttp.ClientError, ValueError, asyncio.TimeoutError):
            return None
        if not isinstance(data, dict) or "cache" not in data:
            return None
        return {"cache": data["cache"], "scheduler": data.get("scheduler", {})}

    async def flush_cache(self) -> bool:
        try:
            async with self.session.post(self.root + "/flush_cache") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    # ------------------------------------------------------------------ one request
    async def send(self, rid: str, endpoint: str, body: dict[str, Any], record: bool = True) -> RequestRecord:
        path = "/completions" if endpoint == "completions" else "/chat/completions"
        rec = RequestRecord(rid, endpoint, body, max(int(body.get("n", 1) or 1), 1))
        payload = (dict(body, model=self.model, stream=True, stream_options={"include_usage": True}) if self.stream
                   else dict(body, model=self.model, stream=False))
        async with self._sem:
            if record:
                self.records.append(rec)
            rec.sent_at = time.perf_counter() - self._t0
            try:
                async with self.session.post(self.base + path, json=payload, headers=self.headers) as resp:
                    if resp.status != 200:
                        rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    elif self.stream:
                        await self._read_stream(resp, rec)
                    else:
                        self._read_reply(await resp.json(content_type=None), rec)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                rec.error = f"{type(exc).__name__}: {exc}"[:200]
            rec.done_at = time.perf_counter() - self._t0
        if self._bar is not None and record:
            self._bar.update(1)
            if rec.error is not None:
                self._bar.set_postfix(errors=sum(1 for r in self.records if r.error is not None))
        return rec

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord) -> None:
        buf = b""
        async for raw in resp.content:  # lines, possibly split when longer than aiohttp's buffer
            buf += raw
            if not buf.endswith(b"\n"):
                continue
            line, buf = buf.strip(), b""
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            chunk = json.loads(data)
            if take_error_or_usage(chunk, rec):
                return
            for choice in chunk.get("choices") or []:
                idx = int(choice.get("index", 0))
                if rec.endpoint == "completions":
                    piece = choice.get("text") or ""
                else:
                    piece = (choice.get("delta") or {}).get("content") or ""
                rec.texts.setdefault(idx, "")
                if piece:
                    if rec.first_token_at is None:
                        rec.first_token_at = time.perf_counter() - self._t0
                    rec.texts[idx] += piece
                    rec.chunks += 1

    @staticmethod
    def _read_reply(reply: dict[str, Any], rec: RequestRecord) -> None:
        """An unstreamed reply: every choice's whole text and the usage."""
        if take_error_or_usage(reply, rec):
            return
        for choice in reply.get("choices") or []:
            idx = int(choice.get("index", 0))
            text = choice.get("text") if rec.endpoint == "completions" else (choice.get("message") or {}).get("content")
            rec.texts[idx] = text or ""
            rec.chunks += 1 if text else 0

    # ------------------------------------------------------------------ workloads
    async def _run_request(self, req: dict[str, Any]) -> None:
        body = req["body"]
        n = max(int(body.get("n", 1) or 1), 1)
        if n == 1 or self.n_mode == "native":
            await self.send(req["id"], req["endpoint"], body)
            return
        subs = []
        for j in range(n):
            sub = dict(body, n=1)
            if "seed" in sub:
                sub["seed"] = int(sub["seed"]) + j
            subs.append(self.send(f"{req['id']}/{j}", req["endpoint"], sub))
        await asyncio.gather(*subs)

    async def _run_session(self, sess: dict[str, Any]) -> None:
        history = copy.deepcopy(sess["messages"])
        for i, step in enumerate(sess["steps"]):
            history = history + copy.deepcopy(step["append"])
            rec = await self.send(f"{sess['id']}/{i}", "chat", dict(step["body"], messages=history))
            if not rec.ok:
                if self._bar is not None:  # the session's remaining steps will not run
                    self._bar.update(len(sess["steps"]) - i - 1)
                return
            history = history + [{"role": "assistant", "content": rec.texts.get(0, "")}]

    async def warmup(self) -> None:
        """One small request, not recorded: pays one-time costs (connections, lazy initialisation). Its
        first token differs from every workload prompt's, so it leaves nothing a workload could reuse."""
        await self.send("warmup", "completions", WARMUP_BODY, record=False)

    async def run(self, wl: dict[str, Any]) -> RunResult:
        self.records = []
        total = count_http_requests(wl, self.n_mode)
        self._bar = tqdm(total=total, desc=self.label or wl["name"], unit="req", disable=not self.progress,
                         dynamic_ncols=True, leave=True)
        before = await self.server_info()
        self._t0 = time.perf_counter()
        try:
            if wl["kind"] == "independent":
                await asyncio.gather(*(self._run_request(r) for r in wl["requests"]))
            else:
                await asyncio.gather(*(self._run_session(s) for s in wl["sessions"]))
            wall = time.perf_counter() - self._t0
        finally:
            self._bar.close()
            self._bar = None
        after = await self.server_info() if before is not None else None
        return RunResult(wl["name"], dict(wl["params"]), wl.get("description", ""), self.base,
                         sorted(self.records, key=lambda r: r.sent_at), wall, before, after)


async def run_workload_async(url: str, wl: dict[str, Any], *, concurrency: int = 8, n_mode: str = "native",
                             model: str | None = None, timeout: float = 1800.0, progress: bool = True,
                             label: str = "", warmup: bool = True, flush: bool = False,
                             stream: bool = True) -> RunResult:
    async with OpenAIClient(url, concurrency=concurrency, n_mode=n_mode, timeout=timeout, model=model,
                            progress=progress, label=label, stream=stream) as client:
        if warmup:
            await client.warmup()
        if flush and not await client.flush_cache():
            print(f"note: {client.root}/flush_cache is not available; the server's cache stays warm")
        return await client.run(wl)


def run_workload(url: str, wl: dict[str, Any], **kw: Any) -> RunResult:
    """Run one workload against an OpenAI-compatible URL (blocking); see ``run_workload_async``."""
    return asyncio.run(run_workload_async(url, wl, **kw))
