"""Exact mode's view of the workers' caches: one ZMQ SUB per worker and the ``CacheMirror`` it feeds.

A worker started with ``--kv-events-port P`` publishes every block its radix cache stores or evicts
(``runtime/server/kv_events.py``); a new subscriber first gets a snapshot (``cleared`` + every cached block). So
the mirror never needs history: on a gap in ``seq`` (a dropped message) the feed simply resubscribes and
takes the next snapshot, and a worker that restarts on the same port sends one by itself when the SUB
socket reconnects.

Matching follows the worker's own rule: ``CacheMirror.match_len`` semantics (whole blocks, chained
hashes from the namespace's root), computed here once per request for all workers — the block hashes of
a prompt do not depend on the worker, only the lookups do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from array import array
from collections.abc import Hashable, Sequence
from typing import Any
from urllib.parse import urlsplit

import orjson
import zmq
import zmq.asyncio

from radix.events import AllBlocksCleared, CacheMirror, chain_hashes, root_hash
from runtime.server.kv_events import TOPIC, event_from_json

logger = logging.getLogger(__name__)


def endpoint_from_info(worker_url: str, info: dict[str, Any]) -> str | None:
    """tcp://<the worker URL's host>:<kv_events_port from its /get_server_info>, or None if it has none."""
    port = info.get("kv_events_port")
    if not port:
        return None
    host = urlsplit(worker_url).hostname or "127.0.0.1"
    return f"tcp://{host}:{int(port)}"


class KvEventFeed:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str):
        self.ctx = ctx
        self.endpoint = endpoint
        self.mirror = CacheMirror()
        self.seq = 0
        self.messages = 0
        self.resyncs = 0
        self.synced = False  # a snapshot has arrived: the mirror is complete
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._close()

    def _open(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sock.connect(self.endpoint)
        return sock

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _run(self) -> None:
        self._sock = self._open()
        while True:
            try:
                _topic, payload = await self._sock.recv_multipart()
                msg = orjson.loads(payload)
                events = [event_from_json(e) for e in msg["events"]]
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("bad cache event message from %s: %s", self.endpoint, exc)
                continue
            seq = int(msg.get("seq", 0))
            snapshot = bool(events) and isinstance(events[0], AllBlocksCleared)
            if not snapshot and (not self.synced or seq != self.seq + 1):
                if self.synced:
                    # A message was lost: the mirror may be wrong from here on. Subscribe again to get
                    # a fresh snapshot, and ignore what comes before it.
                    logger.warning("cache events from %s: expected seq %d, got %d; resubscribing",
                                   self.endpoint, self.seq + 1, seq)
                    self.synced = False
                    self.resyncs += 1
                    self._close()
                    self._sock = self._open()
                continue
            for ev in events:
                self.mirror.apply(ev)
            self.seq = seq
            self.messages += 1
            self.synced = True

    def describe(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "synced": self.synced, "seq": self.seq,
                "blocks": len(self.mirror.blocks), "block_size": self.mirror.block_size,
                "resyncs": self.resyncs}


class KvEventHub:
    """The feeds of all workers, by worker URL."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.feeds: dict[str, KvEventFeed] = {}

    def add(self, url: str, endpoint: str) -> KvEventFeed:
        feed = self.feeds.get(url)
        if feed is not None and feed.endpoint == endpoint:
            return feed
        if feed is not None:
            self._drop(url)
        feed = KvEventFeed(self.ctx, endpoint)
        feed.start()
        self.feeds[url] = feed
        return feed

    def _drop(self, url: str) -> None:
        feed = self.feeds.pop(url, None)
        if feed is not None:
            asyncio.get_running_loop().create_task(feed.stop())

    def remove(self, url: str) -> None:
        self._drop(url)

    async def close(self) -> None:
        for feed in list(self.feeds.values()):
            await feed.stop()
        self.feeds.clear()
        self.ctx.destroy(linger=0)

    def match_lens(self, tokens: Sequence[int], namespace: Hashable | None,
                   urls: Sequence[str]) -> dict[str, int]:
        """Cached prefix length of ``tokens`` on each worker (0 for workers without a synced feed)."""
        out: dict[str, int] = {}
        hashes_by_bs: dict[int, array] = {}
        key = array("i", tokens).tobytes()
        for url in urls:
            feed = self.feeds.get(url)
            if feed is None or not feed.synced or not feed.mirror.blocks:
                out[url] = 0
                continue
            bs = feed.mirror.block_size
            hashes = hashes_by_bs.get(bs)
            if hashes is None:
                full = len(tokens) // bs * bs
                hashes = chain_hashes(root_hash(namespace), key[: 4 * full], 4 * bs)
                hashes_by_bs[bs] = hashes
            blocks = feed.mirror.blocks
            n = 0
            for h in hashes:
                if h not in blocks:
                    break
                n += 1
            out[url] = n * bs
        return out
