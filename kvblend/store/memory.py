"""In-process memory tier: tensors kept as is, LRU-evicted beyond a byte budget. Thread-safe."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

from kvblend.store.base import ChunkKV, KVStore
from kvblend.store.lru import LRUIndex
from kvblend.store.reader import KVReader, TensorReader
from kvblend.store.stats import TierStats


def _compact(t: torch.Tensor) -> torch.Tensor:
    """Contiguous tensor owning exactly its bytes: a view into a bigger buffer would pin that whole
    buffer while the budget counted only the view."""
    t = t.detach().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


class MemoryStore(KVStore):
    """``get`` returns the stored tensors themselves (no copy): callers must treat
    them as read-only."""

    name = "memory"

    def __init__(self, max_bytes: int = 2 << 30):
        self._data: dict[str, ChunkKV] = {}
        self._lru = LRUIndex(max_bytes)
        self._lock = threading.Lock()
        self._stats = TierStats()

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            kv = self._data.get(key)
            if kv is not None:
                self._lru.touch(key)
        self._stats.inc("hits" if kv is not None else "misses")
        return kv

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def open(self, key: str) -> KVReader | None:
        kv = self.get(key)
        return TensorReader(kv) if kv is not None else None

    def put(self, key: str, kv: ChunkKV) -> None:
        """Store ``kv`` (entries larger than the whole budget are skipped), evicting LRU entries."""
        if not self._lru.fits(kv.nbytes):
            return
        kv = ChunkKV(_compact(kv.k), _compact(kv.v))
        with self._lock:
            evicted = self._lru.add(key, kv.nbytes)
            self._data[key] = kv
            for old in evicted:
                del self._data[old]
        self._stats.inc("writes")
        self._stats.inc("evictions", len(evicted))

    def entries(self) -> Iterator[tuple[str, int]]:
        with self._lock:
            return iter([(k, self._lru.size(k) or 0) for k in self._lru.keys()])

    def clear(self) -> int:
        with self._lock:
            n = len(self._data)
            self._data.clear()
            for k in self._lru.keys():
                self._lru.remove(k)
        return n

    def max_entry_bytes(self) -> int | None:
        return self._lru.budget  # an entry over the whole budget is never stored

    def stats(self) -> dict:
        with self._lock:
            entries, nbytes = len(self._data), self._lru.nbytes
        return self._stats.snapshot(entries=entries, bytes=nbytes, budget_bytes=self._lru.budget)

    def check_integrity(self) -> None:
        with self._lock:
            self._lru.check()
            assert set(self._data) == set(self._lru.keys()), (
                "memory tier: data and LRU index disagree"
            )
            actual = sum(kv.nbytes for kv in self._data.values())
            assert actual == self._lru.nbytes, (
                f"memory tier: entries hold {actual} bytes, tracked {self._lru.nbytes}"
            )
