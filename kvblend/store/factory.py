"""``create_store``: the one place a StoreConfig becomes a KVStore."""

from __future__ import annotations

from kvblend.config import StoreConfig
from kvblend.store.base import KVStore
from kvblend.store.tiered import INLINE_TIERS, TieredStore
from kvblend.store.writer import BackgroundWriter


def create_tier(name: str, cfg: StoreConfig) -> KVStore:
    """One backend by name ("memory" | "disk" | "redis"); imports stay lazy (redis is
    optional at runtime)."""
    if name == "memory":
        from kvblend.store.memory import MemoryStore

        return MemoryStore(cfg.memory_bytes)
    if name == "disk":
        from kvblend.store.disk import DiskStore

        return DiskStore(cfg.disk_dir, cfg.disk_bytes, fsync=cfg.disk_fsync)
    if name == "redis":
        from kvblend.store.redis_store import RedisStore

        return RedisStore(
            cfg.redis_url,
            prefix=cfg.redis_prefix,
            ttl_s=cfg.redis_ttl_s,
            socket_timeout_s=cfg.redis_socket_timeout_s,
            backoff_s=cfg.redis_backoff_s,
            backoff_max_s=cfg.redis_backoff_max_s,
        )
    raise ValueError(f"unknown store tier {name!r}")


def create_store(cfg: StoreConfig | None = None) -> TieredStore:
    """Tiers in ``cfg.tiers`` order behind one TieredStore; one background writer if
    any tier is slow."""
    cfg = cfg or StoreConfig()
    tiers = [create_tier(name, cfg) for name in cfg.tiers]
    needs_writer = cfg.async_writes and any(name not in INLINE_TIERS for name in cfg.tiers)
    writer = BackgroundWriter(cfg.writer_max_pending_bytes) if needs_writer else None
    return TieredStore(tiers, writer)
