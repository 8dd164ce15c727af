"""In-process memory tier (placeholder: a plain dict until the LRU tier lands)."""

from __future__ import annotations

import threading

from kvblend.store.base import ChunkKV, KVStore


class MemoryStore(KVStore):
    def __init__(self):
        self._data: dict[str, ChunkKV] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            return self._data.get(key)

    def put(self, key: str, kv: ChunkKV) -> None:
        with self._lock:
            self._data[key] = kv
