"""RouterService: the router's parts wired together, and what happens when workers come and go.

It owns the upstream HTTP session, the worker registry, the slot gate, the policy, the health checker and
the proxy. Registry events drive the rest: a worker added gets a policy entry and an immediate probe; a
worker that turns healthy gets its model info fetched (and, in exact mode, its event feed connected, and
the tokenizer loaded if it is the first); a worker removed is forgotten by the policy and the metrics.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from router.config import RouterArgs
from router.errors import RouterError
from router.health import HealthChecker
from router.metrics import RouterMetrics
from router.policies import make_policy
from router.proxy import Proxy
from router.tokens import RequestTokenizer
from router.workers import SlotGate, Worker, WorkerRegistry
from runtime.http.auth import bearer

logger = logging.getLogger(__name__)
INFO_TIMEOUT = aiohttp.ClientTimeout(total=30)


class RouterService:
    def __init__(self, args: RouterArgs):
        args.validate()
        self.args = args
        self.registry = WorkerRegistry(args.health_failure_threshold, args.health_success_threshold)
        self.gate = SlotGate(self.registry, args.max_inflight_per_worker, args.max_queued_requests,
                             args.queue_timeout)
        self.policy = make_policy(args)
        self.metrics = RouterMetrics(self.policy.name)
        self.registry.listeners.append(self._on_change)
        self._tokenizer_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.session: aiohttp.ClientSession
        self.health: HealthChecker
        self.proxy: Proxy

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            # Idle upstream connections are dropped before uvicorn's 5 s keep-alive would drop them, so a
            # request is never written into a connection the worker is closing (which would look like a
            # failed worker).
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.args.connect_timeout),
            auto_decompress=False,
            # the router's own calls (health, info, fan-out) carry the key; proxied requests carry the
            # client's, which the router already checked is the same
            headers=bearer(self.args.api_key) if self.args.api_key else None,
        )
        self.health = HealthChecker(self.registry, self.session, self.args.health_check_interval,
                                    self.args.health_check_timeout)
        self.proxy = Proxy(self.session, self.registry, self.gate, self.policy, self.metrics, self.health,
                           self.args.max_retries)
        await self.policy.start()
        events: list[str | None] = [*self.args.kv_events_endpoints] or [None] * len(self.args.worker_urls)
        added = [self.registry.add(url, ev)[0] for url, ev in zip(self.args.worker_urls, events)]
        await asyncio.gather(*(self.health.check(w) for w in added))
        if self.policy.needs_tokenizer and (self.args.tokenizer or self.registry.healthy()):
            # Fail at start rather than route every request blind.
            await self.ensure_tokenizer(required=True)
        self.health.start()

    async def stop(self) -> None:
        await self.health.stop()
        for t in list(self._tasks):
            t.cancel()
        await self.policy.stop()
        await self.session.close()

    # ------------------------------------------------------------------ registry events
    def _on_change(self, worker: Worker, what: str) -> None:
        if what == "added":
            self.policy.add_worker(worker)
        elif what == "removed":
            self.policy.remove_worker(worker)
            self.metrics.forget(worker.url)
        elif what == "healthy":
            self._spawn(self._on_ready(worker))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_ready(self, worker: Worker) -> None:
        try:
            if not worker.info:
                worker.info = await self.get_json(worker, "/get_model_info")
            if self.policy.name == "exact":
                info = {} if worker.kv_events else await self.get_json(worker, "/get_server_info")
                await self.policy.worker_ready(worker, info)
            await self.ensure_tokenizer()
        except Exception as exc:
            logger.warning("setting up worker %s failed: %s", worker.url, exc)

    async def get_json(self, worker: Worker, path: str) -> dict[str, Any]:
        async with self.session.get(worker.url + path, timeout=INFO_TIMEOUT) as resp:
            if resp.status != 200:
                raise RouterError(502, f"{worker.url}{path} answered {resp.status}")
            data = orjson.loads(await resp.read())
            if not isinstance(data, dict):
                raise RouterError(502, f"{worker.url}{path} did not answer a JSON object")
            return data

    async def ensure_tokenizer(self, required: bool = False) -> None:
        """Load the tokenizer the policy needs, once: --tokenizer, else the first healthy worker's."""
        if not self.policy.needs_tokenizer or self.policy.tokenizer is not None:
            return
        async with self._tokenizer_lock:
            if self.policy.tokenizer is not None:
                return
            path, template = self.args.tokenizer, None
            if self.args.chat_template:
                template = Path(self.args.chat_template).read_text()
            if path is None or template is None:
                for w in self.registry.healthy():
                    info = w.info or await self.get_json(w, "/get_model_info")
                    w.info = info
                    path = path or info.get("tokenizer_path") or info.get("model_path")
                    template = template or info.get("chat_template")
                    break
            if path is None:
                if required:
                    raise RuntimeError("the policy needs a tokenizer: give --tokenizer or a reachable worker")
                return
            try:
                tok = await asyncio.to_thread(RequestTokenizer.load, path, template)
            except Exception as exc:
                msg = (f"cannot load the tokenizer at {path} for {self.policy.name} routing ({exc}); give a "
                       "local copy with --tokenizer")
                if required:
                    raise RuntimeError(msg) from exc
                logger.error("%s", msg)
                return
            self.policy.tokenizer = tok
            logger.info("routing tokenizer loaded from %s", path)

    # ------------------------------------------------------------------ worker management (API)
    async def add_worker(self, url: str, kv_events: str | None = None) -> tuple[Worker, bool]:
        worker, created = self.registry.add(url, kv_events)
        if kv_events and not created:
            self.policy.add_worker(worker)  # a new event endpoint for a known worker
        if await self.health.check(worker) and not created:
            self.registry.reinstate(worker)  # re-adding a known worker says "it is back": one check will do
        return worker, created

    def remove_worker(self, url: str) -> Worker | None:
        return self.registry.remove(url)

    def describe_workers(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "queued": self.gate.waiting,
            "max_inflight_per_worker": self.gate.limit,
            "imbalance_guard_overrides": getattr(self.policy, "guard_overrides", 0),
            "workers": [{**w.as_json(), **self.policy.describe(w), **self.metrics.worker_stats(w.url)}
                        for w in self.registry],
        }

    # ------------------------------------------------------------------ fan-out
    async def fan_out(self, method: str, path: str, body: bytes | None = None
                      ) -> list[tuple[Worker, int, Any]]:
        """The same call on every healthy worker: (worker, status, parsed JSON or error text)."""

        async def one(w: Worker) -> tuple[Worker, int, Any]:
            try:
                async with self.session.request(method, w.url + path, data=body, timeout=INFO_TIMEOUT,
                                                headers={"content-type": "application/json"}) as resp:
                    raw = await resp.read()
                    try:
                        return w, resp.status, orjson.loads(raw)
                    except orjson.JSONDecodeError:
                        return w, resp.status, raw.decode(errors="replace")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                return w, 502, f"{type(exc).__name__}: {exc}"

        return list(await asyncio.gather(*(one(w) for w in self.registry.healthy())))

    async def server_info(self) -> dict[str, Any]:
        """One worker's /get_server_info shape, with queue and cache figures summed over all workers."""
        answers = [(w, data) for w, status, data in await self.fan_out("GET", "/get_server_info")
                   if status == 200 and isinstance(data, dict)]
        if not answers:
            raise RouterError(503, "no healthy worker answered /get_server_info", "no_healthy_worker")
        merged: dict[str, Any] = dict(answers[0][1])
        merged.update(host=self.args.host, port=self.args.port)
        for key in ("num_running_reqs", "num_waiting_reqs"):
            merged[key] = sum(int(d.get(key, 0)) for _, d in answers)
        cache: dict[str, Any] = dict(merged.get("cache") or {})
        for key in ("hit_tokens", "miss_tokens", "cached_tokens", "num_nodes", "evictable_size",
                    "protected_size", "evicted_tokens"):
            cache[key] = sum(int((d.get("cache") or {}).get(key, 0)) for _, d in answers)
        looked = cache["hit_tokens"] + cache["miss_tokens"]
        cache["hit_rate"] = round(cache["hit_tokens"] / looked, 4) if looked else 0.0
        merged["cache"] = cache
        merged["dp_size"] = len(answers)
        merged["workers"] = [{"url": w.url, "num_running_reqs": d.get("num_running_reqs"),
                              "num_waiting_reqs": d.get("num_waiting_reqs"), "cache": d.get("cache")}
                             for w, d in answers]
        merged["router"] = self.describe_workers()
        return merged
