"""exact: the cache_aware rule, with match lengths read from each worker's real cache.

The workers publish their radix-cache events (``--kv-events-port``); ``router.kv_mirror.KvEventHub`` mirrors
every worker's cached blocks, and a request's match on a worker is the prefix the worker's tree would
report for it. Like the worker, it matches the prompt without its last token (the worker always computes
at least one token, so that is all it can reuse): with the events caught up, the predicted match equals
the ``cached_tokens`` the worker then reports.

The events only show a prefix once the worker has computed it. Requests sent meanwhile (a burst sharing
a new prefix) would all see "no match" and scatter, so the policy also remembers the prompts it has in
flight on each worker: a match against one of them counts too. The prediction reported for a request
is the larger of the two.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any

from router.kv_mirror import KvEventHub, endpoint_from_info
from router.policies.base import Choice
from router.policies.cache_aware import AffinityPolicy
from router.prefix_tree import common_prefix_len
from router.request_view import RequestView
from router.workers import Worker

logger = logging.getLogger(__name__)


class Exact(AffinityPolicy):
    name = "exact"
    needs_tokenizer = True

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 8,
                 balance_rel_threshold: float = 1.5):
        super().__init__(cache_threshold, balance_abs_threshold, balance_rel_threshold)
        self.hub: KvEventHub | None = None
        # worker URL -> id(view) -> (namespace, prompt key) of the requests in flight there
        self._inflight: dict[str, dict[int, tuple[str | None, bytes]]] = {}

    async def start(self) -> None:
        self.hub = KvEventHub()

    async def stop(self) -> None:
        if self.hub is not None:
            await self.hub.close()

    # ------------------------------------------------------------------ workers
    def add_worker(self, worker: Worker) -> None:
        self._inflight.setdefault(worker.url, {})
        if worker.kv_events and self.hub is not None:
            self.hub.add(worker.url, worker.kv_events)

    def remove_worker(self, worker: Worker) -> None:
        super().remove_worker(worker)
        self._inflight.pop(worker.url, None)
        if self.hub is not None:
            self.hub.remove(worker.url)

    async def worker_ready(self, worker: Worker, info: dict[str, Any]) -> None:
        if self.hub is None:
            return
        if not worker.kv_events:
            worker.kv_events = endpoint_from_info(worker.url, info)
            if not worker.kv_events:
                logger.warning("worker %s publishes no cache events (start it with --kv-events-port): exact "
                               "mode sees its cache as empty", worker.url)
                return
        self.hub.add(worker.url, worker.kv_events)

    # ------------------------------------------------------------------ matching
    def prepare(self, view: RequestView) -> None:
        ids = self.tokenizer.prompt_ids(view) if self.tokenizer is not None else None
        view.key = array("i", ids).tobytes() if ids else None

    def matches(self, view: RequestView, candidates: list[Worker]) -> tuple[dict[str, int], int] | None:
        if view.key is None or view.tokens is None or self.hub is None:
            return None
        tokens = view.tokens
        reusable = tokens[:-1]  # the worker recomputes the last prompt token in any case
        real = self.hub.match_lens(reusable, view.namespace, [w.url for w in candidates])
        key = view.key[: 4 * len(reusable)]
        out = {}
        for w in candidates:
            best = real.get(w.url, 0)
            for ns, other in self._inflight.get(w.url, {}).values():
                if ns == view.namespace and len(other) > 4 * best:
                    best = max(best, common_prefix_len(other, key, 0, 4) // 4)
            out[w.url] = best
        return out, len(tokens)

    def held(self, worker: Worker) -> int:
        feed = self.hub.feeds.get(worker.url) if self.hub is not None else None
        return len(feed.mirror.blocks) if feed is not None else 0

    def select(self, view: RequestView, candidates: list[Worker]) -> Choice:
        choice = super().select(view, candidates)
        if view.key is not None:
            self._inflight.setdefault(choice.worker.url, {})[id(view)] = (view.namespace, view.key)
        return choice

    def on_finished(self, view: RequestView, choice: Choice, ok: bool, completion: str | None) -> None:
        self._inflight.get(choice.worker.url, {}).pop(id(view), None)

    def describe(self, worker: Worker) -> dict[str, Any]:
        feed = self.hub.feeds.get(worker.url) if self.hub is not None else None
        return {"kv_feed": feed.describe() if feed is not None else None,
                "inflight_prompts": len(self._inflight.get(worker.url, {}))}
