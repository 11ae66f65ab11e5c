"""The scheduler loop's two transports: ZMQ sockets between the server's processes, queues inside an Engine.

Both carry the same typed messages (``runtime.core.messages``): requests, aborts and one ``ControlQuery``
class per control request in; outputs, ``ControlReply`` and ``SchedulerStatus`` out.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable

import zmq

from runtime.core.messages import BatchTokenOut, ControlQuery, ControlReply, ReqOutput, SchedulerStatus
from runtime.server.ipc import Endpoints, decode, encode, parent_alive, pull, push
from runtime.server.scheduler_loop import Incoming, Transport

REPLY_CHECK_S = 0.5  # how often a caller waiting for a control reply checks that the scheduler thread lives


class ZmqTransport(Transport):
    """The scheduler process's sockets: requests, aborts and queries come from the tokenizer manager; outputs go
    to the detokenizer process; replies and the status go straight back to the tokenizer manager."""

    idle_timeout = 0.5  # an idle scheduler wakes this often to notice that the server process is gone

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, to_tm: zmq.Socket, parent_pid: int):
        self.inbox = pull(ctx, endpoints.scheduler)
        self.to_detok = push(ctx, endpoints.detokenizer)
        self.to_tm = to_tm
        self.parent_pid = parent_pid

    def receive(self, timeout: float | None) -> list[Incoming]:
        if not self.inbox.poll(None if timeout is None else int(timeout * 1000)):
            return []
        msgs: list[Incoming] = []
        while True:
            try:
                msgs.append(decode(self.inbox.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return msgs

    def deliver(self, outputs: list[ReqOutput]) -> None:
        self.to_detok.send(encode(BatchTokenOut(outputs)))

    def reply(self, reply: ControlReply) -> None:
        # the exception stays here: not every exception pickles, and the reply's message says what failed
        self.to_tm.send(encode(dataclasses.replace(reply, error=None)))

    def publish_status(self, status: SchedulerStatus) -> None:
        self.to_tm.send(encode(status))

    def stopped(self, idle: bool) -> bool:
        # the work in hand is finished first; PR_SET_PDEATHSIG usually ends the process before this is needed
        return idle and not parent_alive(self.parent_pid)


class QueueTransport(Transport):
    """Between an Engine's callers (any threads) and its scheduler thread. The callers ``send`` requests and
    aborts and ``ask`` control queries; the scheduler thread hands each step's outputs to ``deliver`` (the
    Engine routes them to its requests' handles)."""

    idle_timeout = None  # an idle Engine blocks until a message comes; ``close`` sends one

    def __init__(self, deliver: Callable[[list[ReqOutput]], None]):
        self._inbox: queue.SimpleQueue[Incoming | None] = queue.SimpleQueue()
        self._deliver = deliver
        self._replies: dict[str, queue.SimpleQueue[ControlReply]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.last_status: SchedulerStatus | None = None

    # ------------------------------------------------------------------ the callers' side
    def send(self, msg: Incoming) -> None:
        self._inbox.put(msg)

    def ask(self, query: ControlQuery, check_alive: Callable[[], None]) -> ControlReply:
        """Send ``query`` and wait for its reply; ``check_alive`` raises once the scheduler thread has died,
        so a caller never waits for a reply that cannot come."""
        box: queue.SimpleQueue[ControlReply] = queue.SimpleQueue()
        with self._lock:
            self._replies[query.req_id] = box
        try:
            self.send(query)
            while True:
                try:
                    return box.get(timeout=REPLY_CHECK_S)
                except queue.Empty:
                    check_alive()
        finally:
            with self._lock:
                self._replies.pop(query.req_id, None)

    def close(self) -> None:
        """Stop the loop after its current iteration (waking it if it blocks)."""
        self._closed.set()
        self._inbox.put(None)

    # ------------------------------------------------------------------ the scheduler thread's side
    def receive(self, timeout: float | None) -> list[Incoming]:
        msgs: list[Incoming] = []
        block = timeout != 0.0
        while True:
            try:
                msg = self._inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return msgs
            block = False  # after the first, take only what is queued already
            if msg is not None:  # None only wakes the loop (``close``)
                msgs.append(msg)

    def deliver(self, outputs: list[ReqOutput]) -> None:
        self._deliver(outputs)

    def reply(self, reply: ControlReply) -> None:
        with self._lock:
            box = self._replies.get(reply.req_id)
        if box is not None:  # None: its caller stopped waiting
            box.put(reply)

    def publish_status(self, status: SchedulerStatus) -> None:
        self.last_status = status

    def stopped(self, idle: bool) -> bool:
        return self._closed.is_set()
