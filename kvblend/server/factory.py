"""What a ServerConfig's models and store become: the one place backends are built (local engines
and upstream services side by side, so neither backend module imports the other)."""

from __future__ import annotations

from kvblend.config import ServerConfig
from kvblend.server.backends import Backend, LocalBackend
from kvblend.server.upstream import UpstreamBackend
from kvblend.store.base import KVStore
from kvblend.store.factory import create_store


def create_backends(config: ServerConfig, store: KVStore) -> list[Backend]:
    """One backend per configured model; the local ones share ``store`` (keys carry the model's
    fingerprint)."""
    out: list[Backend] = []
    for entry in config.models:
        if entry.kind == "local":
            out.append(LocalBackend(entry, store, config))
        elif entry.kind == "upstream":
            out.append(UpstreamBackend(entry, config))
        else:
            raise ValueError(
                f"model {entry.id!r}: backend kind {entry.kind!r} is not implemented yet"
            )
    return out


__all__ = ["create_backends", "create_store"]
