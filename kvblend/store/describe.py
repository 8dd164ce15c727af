"""One-line descriptions of a store's tiers, for `kvblend serve`'s summary and `kvblend store`."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from kvblend.config import StoreConfig


def format_bytes(num_bytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"


def mask_url_password(url: str) -> str:
    """redis://user:secret@host -> redis://user:***@host (the summary goes to logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


def describe_store(cfg: StoreConfig) -> str:
    """Tiers in lookup order with their budgets, e.g. ``memory 8.0 GiB -> disk
    /var/kv 20.0 GiB``."""
    parts = []
    for tier in cfg.tiers:
        if tier == "memory":
            parts.append(f"memory {format_bytes(cfg.memory_bytes)}")
        elif tier == "disk":
            parts.append(f"disk {cfg.disk_dir} {format_bytes(cfg.disk_bytes)}")
        else:
            ttl = f", ttl {cfg.redis_ttl_s} s" if cfg.redis_ttl_s else ""
            parts.append(f"redis {mask_url_password(cfg.redis_url)}{ttl}")
    return " -> ".join(parts)
