"""The narrow interface between the engine and wherever chunk KV lives.

The engine only ever calls ``get``/``put``/``contains`` (and ``open`` for layer-by-layer loading).
Backends move bytes; tensors <-> bytes is the serializer's job, so Redis and disk never see pickle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

from kvblend.store.chunk import ChunkKV
from kvblend.store.reader import KVReader, TensorReader

__all__ = ["ChunkKV", "KVReader", "KVStore"]


class KVStore(ABC):
    """Contract: ``get`` returns either the exact KV that was ``put`` under ``key`` or None (miss).
    A corrupt, truncated or unreachable entry is a miss, never an exception and never wrong KV.
    ``put`` may be asynchronous for remote tiers; the caller must not mutate ``kv`` afterwards."""

    @abstractmethod
    def get(self, key: str) -> ChunkKV | None: ...

    @abstractmethod
    def put(self, key: str, kv: ChunkKV) -> None: ...

    def contains(self, key: str) -> bool:
        return self.get(key) is not None

    def open(self, key: str) -> KVReader | None:
        """A layer-by-layer reader of ``key``'s KV, or None on a miss (see kvblend.store.reader).

        Default: load everything, then serve slices. Backends override to fetch one layer at a time.
        """
        kv = self.get(key)
        return TensorReader(kv) if kv is not None else None

    def max_entry_bytes(self) -> int | None:
        """The largest entry this store can keep (None: no limit of its own)."""
        return None

    def was_discarded(self, key: str) -> bool:
        """True if ``key`` was stored but dropped as corrupt or truncated (recently; bounded).

        Lets the engine recompute such a chunk at once, exactly as a hit would have been used,
        instead of treating it as a cold miss: a damaged entry must never change an answer."""
        return False

    def stats(self) -> dict:
        return {}

    def check_integrity(self) -> None:
        """Raise AssertionError if internal accounting is inconsistent (tests call this)."""

    def entries(self) -> "Iterator[tuple[str, int]]":
        """(key, stored bytes) of every entry this store can see (may scan a remote)."""
        return iter(())

    def clear(self) -> int:
        """Delete every entry; returns how many were deleted."""
        return 0

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until asynchronous writes are done; True if nothing is pending."""
        return True

    def close(self) -> None:
        """Release threads, files and connections. Idempotent."""


class DiscardedKeys:
    """The last ``limit`` keys a tier dropped as corrupt (set / deque ops: atomic under the GIL)."""

    def __init__(self, limit: int = 4096):
        import collections

        self._order: collections.deque[str] = collections.deque(maxlen=limit)
        self._keys: set[str] = set()

    def add(self, key: str) -> None:
        if key in self._keys:
            return
        if len(self._order) == self._order.maxlen:
            self._keys.discard(self._order[0])
        self._order.append(key)
        self._keys.add(key)

    def forget(self, key: str) -> None:
        """Stored again, intact: a later miss is an ordinary miss."""
        self._keys.discard(key)

    def __contains__(self, key: str) -> bool:
        return key in self._keys
