"""Publishing the radix cache's events over ZMQ for routers (exact mode) and dashboards.

Wire format: two-frame messages ``[b"kv", json]`` where json is ``{"seq": n, "events": [...]}`` and each
event is ``{"type": "stored", "namespace", "parent_hash", "block_hashes", "token_ids", "block_size"}``,
``{"type": "removed", "block_hashes"}`` or ``{"type": "cleared"}``. ``seq`` increases by one per message,
so a consumer can tell it missed one. The socket is an XPUB: when a subscriber joins, it is sent a
snapshot (``cleared`` followed by every cached block), so it never depends on history it did not see.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import orjson
import zmq

from radix.events import AllBlocksCleared, BlocksRemoved, BlocksStored, CacheEvent

TOPIC = b"kv"


def event_to_json(ev: CacheEvent) -> dict[str, Any]:
    if isinstance(ev, BlocksStored):
        return {"type": "stored", **dataclasses.asdict(ev)}
    if isinstance(ev, BlocksRemoved):
        return {"type": "removed", "block_hashes": ev.block_hashes}
    return {"type": "cleared"}


def event_from_json(d: dict[str, Any]) -> CacheEvent:
    kind = d.get("type")
    if kind == "stored":
        return BlocksStored(d["namespace"], d["parent_hash"], d["block_hashes"], d["token_ids"], d["block_size"])
    if kind == "removed":
        return BlocksRemoved(d["block_hashes"])
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown cache event type {kind!r}")


class EventPublisher:
    def __init__(self, ctx: zmq.Context, host: str, port: int, snapshot: Callable[[], list[CacheEvent]]):
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://{host}:{port}")
        self.snapshot = snapshot
        self.pending: list[CacheEvent] = []
        self.seq = 0

    def sink(self, ev: CacheEvent) -> None:
        self.pending.append(ev)

    def flush(self) -> None:
        """Answer new subscribers with a snapshot, then publish what happened since the last flush."""
        joined = False
        while self.sock.poll(0):
            msg = self.sock.recv()
            joined = joined or (bool(msg) and msg[0] == 1)
        if joined:
            self.pending = self.snapshot()
        if self.pending:
            self.seq += 1
            body = {"seq": self.seq, "events": [event_to_json(e) for e in self.pending]}
            self.sock.send_multipart([TOPIC, orjson.dumps(body)])
            self.pending = []
