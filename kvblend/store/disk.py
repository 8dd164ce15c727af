"""Disk tier: one file per chunk in a directory, atomic writes, LRU eviction within a byte budget.

- A file becomes visible only complete: written to a temp file, fsynced, then ``os.replace``d.
- LRU order lives in memory and is rebuilt from file mtimes at start (a hit bumps the mtime), so
  it survives restarts; atime is not used because most mounts are relatime/noatime.
- A torn, truncated or corrupt file is a miss: it is deleted and counted as ``corrupt``.
- Several processes may share a directory: each adopts files the others wrote when it reads them;
  each enforces the budget for what it knows, so the directory may briefly exceed it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote

from kvblend.store.base import ChunkKV, DiscardedKeys, KVStore
from kvblend.store.lru import LRUIndex
from kvblend.store.reader import BlobReader, KVReader
from kvblend.store.serializer import CorruptKVError, deserialize, read_header, serialize_parts
from kvblend.store.stats import TierStats

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
STALE_TMP_S = (
    600  # older temp files are leftovers of a crashed writer; younger ones may be in flight
)


class DiskStore(KVStore):
    name = "disk"

    def __init__(self, directory: str | os.PathLike, max_bytes: int = 20 << 30, fsync: bool = True):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._lru = LRUIndex(max_bytes)
        self._lock = (
            threading.Lock()
        )  # guards the index and every unlink/rename, so both stay in step
        self._stats = TierStats()
        self._discarded = DiscardedKeys()
        self._scan()

    # -- paths -----------------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        return self.dir / (quote(key, safe="") + SUFFIX)  # reversible and never a path separator

    @staticmethod
    def _key_of(name: str) -> str:
        return unquote(name[: -len(SUFFIX)])

    def _scan(self) -> None:
        """Rebuild the LRU index from the directory, oldest mtime first; evict
        down to the budget."""
        found = []
        now = time.time()
        for entry in os.scandir(self.dir):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            if entry.name.startswith(TMP_PREFIX):
                if now - st.st_mtime > STALE_TMP_S:
                    _unlink(entry.path)
            elif entry.name.endswith(SUFFIX):
                found.append((st.st_mtime, self._key_of(entry.name), st.st_size))
        with self._lock:
            for _, key, size in sorted(found):
                if self._lru.fits(size):
                    self._evict_locked(self._lru.add(key, size))
                else:
                    _unlink(self.path(key))

    # -- bookkeeping (call with the lock held) -----------------------------------------------------
    def _evict_locked(self, keys: list[str]) -> None:
        for old in keys:
            _unlink(self.path(old))
        self._stats.inc("evictions", len(keys))

    def _discard_corrupt(self, key: str, why: str) -> None:
        log.warning("disk KV entry %s is corrupt (%s); deleted", key[:24], why)
        self._discarded.add(key)
        with self._lock:
            self._lru.remove(key)
            _unlink(self.path(key))
        self._stats.inc("corrupt")

    def _note_hit(self, key: str, size: int) -> None:
        """Most recent in memory and on disk (mtime), adopting files another process wrote."""
        with self._lock:
            if key in self._lru:
                self._lru.touch(key)
            elif self._lru.fits(size):
                self._evict_locked(self._lru.add(key, size))
        try:
            os.utime(self.path(key))
        except OSError:
            pass
        self._stats.inc("hits")

    def _note_gone(self, key: str) -> None:
        with self._lock:
            self._lru.remove(key)  # evicted by another process
        self._stats.inc("misses")

    # -- KVStore -----------------------------------------------------------------------------------
    def get(self, key: str) -> ChunkKV | None:
        try:
            data = self.path(key).read_bytes()
        except FileNotFoundError:
            self._note_gone(key)
            return None
        except OSError as e:
            return self._io_error("read", key, e)
        try:
            kv = deserialize(data, key)
        except CorruptKVError as e:
            self._discard_corrupt(key, str(e))
            self._stats.inc("misses")
            return None
        self._note_hit(key, len(data))
        return kv

    def contains(self, key: str) -> bool:
        return self.path(key).exists()

    def was_discarded(self, key: str) -> bool:
        return key in self._discarded

    def open(self, key: str) -> KVReader | None:
        """Reader doing one ``pread`` per layer on a file descriptor held open, so a concurrent
        replace or eviction cannot mix two files: the reader keeps seeing the inode it opened."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            self._note_gone(key)
            return None
        except OSError as e:
            return self._io_error("open", key, e)
        try:
            size = os.fstat(fd).st_size
            header = read_header(lambda off, n: os.pread(fd, n, off), key)
            if size != header.total_size:
                raise CorruptKVError(f"file is {size} bytes, header says {header.total_size}")
        except (CorruptKVError, OSError) as e:
            os.close(fd)
            self._discard_corrupt(key, str(e))
            self._stats.inc("misses")
            return None
        self._note_hit(key, size)
        return BlobReader(
            header,
            lambda off, n: os.pread(fd, n, off),
            on_corrupt=lambda: self._discard_corrupt(key, "layer checksum"),
            on_close=lambda: os.close(fd),
        )

    def put(self, key: str, kv: ChunkKV) -> None:
        """Write atomically; a key already on disk with the same size is only touched (keys are
        content addresses). Never raises for I/O failures: they are logged and counted."""
        parts = serialize_parts(key, kv)
        size = sum(len(p) for p in parts)
        if not self._lru.fits(size):
            return
        path = self.path(key)
        try:
            if path.stat().st_size == size:
                self._note_existing(key, size)
                return
        except FileNotFoundError:
            pass
        except OSError as e:
            self._io_error("stat", key, e)
            return
        for attempt in range(2):
            try:
                self._write_new(key, parts, size)
                break
            except OSError as e:
                # The device filled before the byte budget did: free the least recently used entries
                # and try once more, so the tier keeps working instead of failing every later write.
                if attempt or e.errno not in _NO_SPACE or not self._free_space(2 * size):
                    self._io_error("write", key, e)
                    return
                log.warning("disk KV tier: %s; evicted least recently used entries to make room", e)
        self._discarded.forget(key)
        self._stats.inc("writes")

    def _write_new(self, key: str, parts: list, size: int) -> None:
        tmp = self.dir / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        try:
            self._write_file(tmp, parts)
            with self._lock:
                os.replace(tmp, self.path(key))
                self._evict_locked(self._lru.add(key, size))
            if self.fsync:
                _fsync_dir(self.dir)
        except OSError:
            _unlink(tmp)
            raise

    def _free_space(self, nbytes: int) -> bool:
        """Evict LRU entries until ``nbytes`` are freed or none is left; True if any was freed."""
        freed, evicted = 0, []
        with self._lock:
            for old in self._lru.keys():
                if freed >= nbytes:
                    break
                freed += self._lru.remove(old)
                evicted.append(old)
            self._evict_locked(evicted)
        self._stats.inc("no_space")
        return bool(evicted)

    def _note_existing(self, key: str, size: int) -> None:
        with self._lock:
            if key in self._lru:
                self._lru.touch(key)
            else:
                self._evict_locked(self._lru.add(key, size))

    def _write_file(self, tmp: Path, parts: list) -> None:
        with open(tmp, "wb") as f:
            for p in parts:
                f.write(p)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    def _io_error(self, what: str, key: str, e: OSError) -> None:
        log.warning("disk KV %s of %s failed: %s", what, key[:24], e)
        self._stats.inc("errors")
        if what in ("read", "open"):
            self._stats.inc("misses")
        return None

    def entries(self) -> Iterator[tuple[str, int]]:
        with self._lock:
            return iter([(k, self._lru.size(k) or 0) for k in self._lru.keys()])

    def clear(self) -> int:
        n = 0
        with self._lock:
            for entry in os.scandir(self.dir):
                if entry.name.endswith(SUFFIX):
                    n += _unlink(entry.path)
            for k in self._lru.keys():
                self._lru.remove(k)
        return n

    def max_entry_bytes(self) -> int | None:
        return self._lru.budget  # an entry over the whole budget is never stored

    def stats(self) -> dict:
        with self._lock:
            entries, nbytes = len(self._lru), self._lru.nbytes
        return self._stats.snapshot(
            entries=entries, bytes=nbytes, budget_bytes=self._lru.budget, dir=str(self.dir)
        )

    def check_integrity(self) -> None:
        """Index invariant, and every indexed file that exists has the indexed size."""
        with self._lock:
            self._lru.check()
            for key in self._lru.keys():
                try:
                    actual = self.path(key).stat().st_size
                except FileNotFoundError:
                    continue  # evicted by another process: the next read drops it from the index
                assert actual == self._lru.size(key), (
                    f"disk tier: {key} is {actual} bytes, indexed {self._lru.size(key)}"
                )


def _unlink(path: str | os.PathLike) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX: the directory entry lives in the directory's data)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
