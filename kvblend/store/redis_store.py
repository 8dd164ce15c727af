"""Redis tier: one string value per chunk (the serializer's blob), shared across processes / hosts.

Cluster friendly: every command touches exactly one key (GET, SET, GETRANGE, STRLEN, EXISTS,
UNLINK), so keys may live in any slot and no hash tags are needed.

Failure policy: the remote is an optimisation. Any connection error or timeout turns into a miss
(reads) or a dropped write, logs one warning, counts ``errors`` and opens a circuit: calls are
skipped (counted ``skipped``) until an exponentially growing backoff expires, then one call probes
the server again. Short socket timeouts bound what a dead server costs a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvblend.store.base import ChunkKV, DiscardedKeys, KVStore
from kvblend.store.reader import BlobReader, KVReader
from kvblend.store.serializer import (
    HEADER_PROBE,
    CorruptKVError,
    deserialize,
    read_header,
    serialize,
)
from kvblend.store.stats import TierStats

log = logging.getLogger(__name__)
T = TypeVar("T")


class RemoteUnavailable(OSError):
    """The server is down or the circuit is open; readers turn this into KVReadError."""


class RedisStore(KVStore):
    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "kvblend:",
        ttl_s: int = 0,
        socket_timeout_s: float = 0.5,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
    ):
        self.url, self.prefix, self.ttl_s = url, prefix, ttl_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        # No client-side retries: our circuit breaker decides when to try again.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        self._stats = TierStats()
        self._discarded = DiscardedKeys()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._failures = 0

    def rkey(self, key: str) -> str:
        return self.prefix + key

    # -- circuit breaker -------------------------------------------------------------------------
    def _call(self, fn: Callable[[redis.Redis], T]) -> T:
        """Run one command; raises RemoteUnavailable when the server is (or is presumed) down."""
        with self._lock:
            if time.monotonic() < self._down_until:
                self._stats.inc("skipped")
                raise RemoteUnavailable("redis circuit open")
        try:
            out = fn(self._client)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            self._trip(e)
            raise RemoteUnavailable(str(e)) from e
        except (
            redis.RedisError
        ) as e:  # server answered with an error (OOM, READONLY, ...): not a down server
            self._stats.inc("errors")
            log.warning("redis KV command failed: %s", e)
            raise RemoteUnavailable(str(e)) from e
        with self._lock:
            if self._failures:
                log.warning("redis KV store at %s reachable again", self.url)
                self._failures = 0
        return out

    def _trip(self, e: Exception) -> None:
        with self._lock:
            delay = min(self.backoff_max_s, self.backoff_s * (2**self._failures))
            self._failures += 1
            self._down_until = time.monotonic() + delay
            first = self._failures == 1
        self._stats.inc("errors")
        if first:
            log.warning(
                "redis KV store at %s unreachable (%s); serving from local tiers, "
                "retrying in %.2fs",
                self.url,
                e,
                delay,
            )
        self._client.connection_pool.disconnect()  # drop dead sockets so the next probe reconnects

    @property
    def available(self) -> bool:
        """False while the circuit is open (after an error, until the backoff expires)."""
        with self._lock:
            return time.monotonic() >= self._down_until

    # -- KVStore -----------------------------------------------------------------------------------
    def get(self, key: str) -> ChunkKV | None:
        try:
            blob = self._call(lambda c: c.get(self.rkey(key)))
        except RemoteUnavailable:
            self._stats.inc("misses")
            return None
        if blob is None:
            self._stats.inc("misses")
            return None
        try:
            kv = deserialize(blob, key)
        except CorruptKVError as e:
            self._discard_corrupt(key, str(e))
            self._stats.inc("misses")
            return None
        self._stats.inc("hits")
        return kv

    def was_discarded(self, key: str) -> bool:
        return key in self._discarded

    def contains(self, key: str) -> bool:
        try:
            return bool(self._call(lambda c: c.exists(self.rkey(key))))
        except RemoteUnavailable:
            return False

    def open(self, key: str) -> KVReader | None:
        """Header and length in one round trip; then one GETRANGE per layer as the reader asks."""
        rkey = self.rkey(key)

        def fetch(off: int, n: int) -> bytes:
            return self._call(lambda c: c.getrange(rkey, off, off + n - 1))

        def head(c: redis.Redis) -> list:
            p = c.pipeline(transaction=False)  # two commands on one key: fine on a cluster too
            p.getrange(rkey, 0, HEADER_PROBE - 1)
            p.strlen(rkey)
            return p.execute()

        try:
            first, size = self._call(head)
            if size == 0:
                self._stats.inc("misses")
                return None
            header = read_header(fetch, key, first)
            if size != header.total_size:
                raise CorruptKVError(f"value is {size} bytes, header says {header.total_size}")
        except RemoteUnavailable:
            self._stats.inc("misses")
            return None
        except CorruptKVError as e:
            self._discard_corrupt(key, str(e))
            self._stats.inc("misses")
            return None
        self._stats.inc("hits")
        return BlobReader(
            header, fetch, on_corrupt=lambda: self._discard_corrupt(key, "layer checksum")
        )

    def put(self, key: str, kv: ChunkKV) -> None:
        """SET with the configured TTL. Never raises for server trouble (counted, logged once)."""
        blob = serialize(key, kv)
        try:
            self._call(lambda c: c.set(self.rkey(key), blob, ex=self.ttl_s or None))
        except RemoteUnavailable:
            return
        self._stats.inc("writes")

    def _discard_corrupt(self, key: str, why: str) -> None:
        log.warning("redis KV entry %s is corrupt (%s); deleted", key[:24], why)
        self._stats.inc("corrupt")
        self._discarded.add(key)
        try:
            self._call(lambda c: c.unlink(self.rkey(key)))
        except RemoteUnavailable:
            pass

    def entries(self) -> Iterator[tuple[str, int]]:
        """SCAN this prefix (on a cluster, run per node); sizes via STRLEN. Empty if unreachable."""
        try:
            keys = self._call(lambda c: list(c.scan_iter(match=self.prefix + "*", count=1000)))
            sizes = self._call(lambda c: _pipelined(c, "strlen", keys))
        except RemoteUnavailable:
            return iter(())
        n = len(self.prefix)
        return iter([(k.decode()[n:], int(s)) for k, s in zip(keys, sizes)])

    def clear(self) -> int:
        try:
            keys = self._call(lambda c: list(c.scan_iter(match=self.prefix + "*", count=1000)))
            return sum(self._call(lambda c: _pipelined(c, "unlink", keys)))
        except RemoteUnavailable:
            return 0

    def stats(self) -> dict:
        return self._stats.snapshot(url=self.url, available=self.available)

    def close(self) -> None:
        self._client.close()


def _pipelined(client: redis.Redis, command: str, keys: list) -> list:
    """One single-key ``command`` per key, batched in a non-transactional pipeline."""
    p = client.pipeline(transaction=False)
    for k in keys:
        getattr(p, command)(k)
    return p.execute()
