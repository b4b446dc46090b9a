"""Stored responses (`store: true`) for `previous_response_id` and GET / DELETE /v1/responses/{id}: in this process
only, bounded by count and by bytes, the oldest evicted first (a server is not a database; a client that needs its
history back after a restart keeps it and sends `input` items instead).

Each entry holds the response object as JSON and the conversation it ends (chat messages without the request's
instructions: OpenAI does not carry `instructions` over to a follow-up), so a follow-up renders the same history.
Read from the event loop and written from the preparation thread and the loop, hence the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_STORED_RESPONSES = 1024
DEFAULT_MAX_STORED_BYTES = 64 << 20


def _message_size(message: dict[str, Any]) -> int:
    """A stored chat message's bytes: its texts, plus a fixed allowance for the keys around them."""
    size = 64 + len(str(message.get("content") or "").encode())
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        size += 64 + len(str(fn.get("name", "")).encode()) + len(str(fn.get("arguments", "")).encode())
    return size


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_json: str  # the ResponseObject as sent
    messages: list[dict[str, Any]]  # the conversation up to and including this response's output
    size: int


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_STORED_BYTES) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, response_json: str, messages: list[dict[str, Any]]) -> bool:
        """Stores (replacing an entry of the same id); False when the one entry alone is over the byte bound.
        Runs on the event loop: the size is counted from the texts (C-speed encodes), not a JSON dump of the whole
        conversation."""
        size = len(response_json.encode()) + sum(_message_size(m) for m in messages)
        if size > self.max_bytes or self.max_responses == 0:
            return False
        with self._lock:
            self._pop(response_id)
            self._entries[response_id] = StoredResponse(response_json, messages, size)
            self._bytes += size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                self._pop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)  # a conversation in use is the last to be evicted
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._pop(response_id)

    def _pop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes
