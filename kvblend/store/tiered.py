"""Tiers in lookup order (memory -> disk -> redis): a hit in a later tier is promoted
into the earlier ones.

Writes go to every tier; the memory tier is written inline (it is a dict insert),
slower tiers through the shared BackgroundWriter so a request never waits on a disk
fsync or a network round trip.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvblend.store.base import ChunkKV, KVStore
from kvblend.store.reader import BlobReader, KVReader
from kvblend.store.serializer import KVHeader, assemble
from kvblend.store.writer import BackgroundWriter

INLINE_TIERS = ("memory",)  # cheap enough to write on the request path


class TieredStore(KVStore):
    def __init__(self, tiers: Sequence[KVStore], writer: BackgroundWriter | None = None):
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self.tiers: list[KVStore] = list(tiers)
        self.writer = writer

    def tier(self, name: str) -> KVStore | None:
        return next((t for t in self.tiers if getattr(t, "name", None) == name), None)

    # -- writes ------------------------------------------------------------------------------------
    def _write(self, key: str, kv: ChunkKV, tiers: Sequence[KVStore]) -> None:
        """Inline tiers now; the others in one background job (or now, without a writer)."""
        slow = [
            t for t in tiers if self.writer is None or getattr(t, "name", None) not in INLINE_TIERS
        ]
        for t in tiers:
            if t not in slow:
                t.put(key, kv)
        if slow:
            self._run(lambda: [t.put(key, kv) for t in slow], kv.nbytes)

    def _run(self, job, nbytes: int) -> None:
        if self.writer is None:
            job()
        else:
            self.writer.submit(job, nbytes)

    def put(self, key: str, kv: ChunkKV) -> None:
        self._write(key, kv, self.tiers)

    # -- reads -------------------------------------------------------------------------------------
    def get(self, key: str) -> ChunkKV | None:
        for i, t in enumerate(self.tiers):
            kv = t.get(key)
            if kv is not None:
                if i:
                    self._write(key, kv, self.tiers[:i])
                return kv
        return None

    def contains(self, key: str) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def max_entry_bytes(self) -> int | None:
        limits = [t.max_entry_bytes() for t in self.tiers]
        return None if any(n is None for n in limits) else max(limits)

    def was_discarded(self, key: str) -> bool:
        return any(t.was_discarded(key) for t in self.tiers)

    def open(self, key: str) -> KVReader | None:
        """Reader from the first tier holding ``key``. A streamed hit from a lower tier is promoted
        once the reader has delivered every layer, from the bytes it already
        fetched (no refetch)."""
        for i, t in enumerate(self.tiers):
            reader = t.open(key)
            if reader is None:
                continue
            if i and isinstance(reader, BlobReader):
                upper, header = self.tiers[:i], reader.header
                reader.on_complete(lambda parts: self._promote_parts(key, header, parts, upper))
            return reader
        return None

    def _promote_parts(
        self, key: str, header: KVHeader, parts: list[bytes], tiers: Sequence[KVStore]
    ) -> None:
        # Runs on the loader thread: hand the decode + writes to the writer so
        # loading is not delayed.
        nbytes = sum(len(p) for p in parts)
        self._run(lambda: self._write_all(key, assemble(header, parts), tiers), nbytes)

    @staticmethod
    def _write_all(key: str, kv: ChunkKV, tiers: Sequence[KVStore]) -> None:
        for t in tiers:
            t.put(key, kv)

    # -- admin -------------------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {getattr(t, "name", type(t).__name__): t.stats() for t in self.tiers}
        if self.writer is not None:
            out["writer"] = self.writer.stats()
        return out

    def check_integrity(self) -> None:
        for t in self.tiers:
            t.check_integrity()

    def clear(self) -> int:
        self.flush()
        return sum(t.clear() for t in self.tiers)

    def flush(self, timeout: float | None = None) -> bool:
        return self.writer.flush(timeout) if self.writer is not None else True

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        for t in self.tiers:
            t.close()
