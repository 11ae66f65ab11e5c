"""The server-side memory of ``/v1/responses``: stored responses, for ``previous_response_id`` and GET.

Each entry keeps the response object as it was sent and the conversation that led to it (the input
items of the whole chain, normalised, then this response's output items), so a follow-up request only
adds its new items and renders the whole conversation again: the prompt it gets starts with the previous
turn's prompt and answer, which the radix cache already holds.

The store is an LRU with a fixed number of entries (the oldest unused one goes first); it lives in the
main process and is lost on restart, like any chain whose first response has been evicted (a 404).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CAPACITY = 1024


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the final response object
    items: list[dict[str, Any]] = field(default_factory=list)  # the conversation, output included


class ResponseStore:
    """A bounded LRU of StoredResponse by response id. Reads count as uses."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError("capacity: must be at least 1")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # the event loop is the only writer today; this keeps it safe anyway

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            self._entries[response_id] = entry
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None
