"""Stored responses for GET /v1/responses/{id} and previous_response_id: bounded in count and in bytes, the
oldest evicted first. In memory, per front process (a restart forgets them, as does another replica: the
Kubernetes Service's ClientIP affinity brings a client back to its replica)."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Stored:
    response: dict          # the response object, as GET returns it
    conversation: list[dict]  # chat messages up to and including its output: what previous_response_id continues
    size: int


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the store's bounds must be >= 0")
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> bool:
        """Stores a response, evicting the oldest ones until both bounds hold; False when it alone exceeds the
        byte bound (it is then not stored)."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        if size > self.max_bytes or self.max_responses == 0:
            return False
        with self._lock:
            old = self._items.pop(response["id"], None)
            if old is not None:
                self._bytes -= old.size
            while self._items and (len(self._items) >= self.max_responses or self._bytes + size > self.max_bytes):
                _, evicted = self._items.popitem(last=False)
                self._bytes -= evicted.size
            self._items[response["id"]] = Stored(response, conversation, size)
            self._bytes += size
        return True

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            old = self._items.pop(response_id, None)
            if old is not None:
                self._bytes -= old.size
            return old is not None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes
