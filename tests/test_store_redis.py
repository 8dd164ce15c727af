"""Redis tier against a real redis-server (fixture ``redis_server`` in conftest.py)."""

from __future__ import annotations

import time

import pytest
import redis
import torch
from helpers import bits, make_kv, same

from kvblend.config import StoreConfig
from kvblend.store.factory import create_store
from kvblend.store.reader import KVReadError
from kvblend.store.redis_store import RedisStore


def _store(server, **kw) -> RedisStore:
    return RedisStore(server.url, socket_timeout_s=0.2, backoff_s=0.05, backoff_max_s=0.2, **kw)


def _until(pred, timeout: float = 5.0):
    """Poll ``pred`` until truthy (returns it) or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_redis_roundtrip_ttl_and_layerwise(redis_server):
    store = _store(redis_server, ttl_s=60)
    kv = make_kv(layers=5)
    store.put("chunk:a", kv)
    assert same(store.get("chunk:a"), kv) and store.contains("chunk:a")
    assert 0 < redis.Redis.from_url(redis_server.url).ttl("kvblend:chunk:a") <= 60
    with store.open("chunk:a") as r:
        for layer in (4, 0, 2):
            k, v = r.read_layer(layer)
            assert torch.equal(bits(k), bits(kv.k[layer])) and torch.equal(
                bits(v), bits(kv.v[layer])
            )
    assert store.get("chunk:none") is None and store.open("chunk:none") is None
    assert [k for k, _ in store.entries()] == ["chunk:a"]
    s = store.stats()
    assert s["hits"] == 2 and s["misses"] == 2 and s["errors"] == 0
    assert store.clear() == 1 and store.get("chunk:a") is None


def test_redis_corrupt_value_is_deleted_miss(redis_server):
    store = _store(redis_server)
    redis.Redis.from_url(redis_server.url).set("kvblend:chunk:a", b"\x80\x04not a kv blob")
    assert store.get("chunk:a") is None and not store.contains("chunk:a")
    assert store.stats()["corrupt"] == 1


def test_redis_killed_degrades_then_reconnects(redis_server, caplog):
    store = _store(redis_server)
    kv = make_kv()
    store.put("chunk:a", kv)
    reader = store.open("chunk:a")
    redis_server.stop()  # crash mid-run
    with pytest.raises(KVReadError):
        reader.read_layer(0)  # an open stream fails as a miss, not with a redis exception
    t0 = time.monotonic()
    assert store.get("chunk:a") is None
    store.put("chunk:b", kv)  # must not raise
    assert store.open("chunk:a") is None and not store.contains("chunk:a")
    assert time.monotonic() - t0 < 2.0  # short timeouts + open circuit: the request is not stalled
    s = store.stats()
    assert (
        s["errors"] >= 1 and s["errors"] + s["skipped"] >= 5
    )  # each call failed fast or was skipped
    assert any("unreachable" in r.message for r in caplog.records)

    redis_server.start()  # same port, empty (no persistence)
    _until(lambda: store.put("chunk:a", kv) or store.get("chunk:a") is not None)
    assert same(store.get("chunk:a"), kv) and store.stats()["available"]


def test_tiered_with_redis_promotes_and_survives_outage(redis_server, tmp_path):
    cfg = StoreConfig(
        tiers=("memory", "disk", "redis"),
        disk_dir=tmp_path,
        redis_url=redis_server.url,
        redis_socket_timeout_s=0.2,
        redis_backoff_s=0.05,
        redis_backoff_max_s=0.2,
    )
    kv, kv2 = make_kv(1), make_kv(2)
    writer = create_store(cfg)
    writer.put("chunk:a", kv)
    writer.put("chunk:b", kv2)
    assert writer.flush(10)
    writer.close()

    other = create_store(
        StoreConfig(**{**cfg.__dict__, "disk_dir": tmp_path / "other"})
    )  # another host: only redis shared
    assert same(other.get("chunk:a"), kv)  # redis hit -> promoted to memory + disk
    with other.open("chunk:b") as r:  # streamed redis hit -> promoted after the last layer
        assert same(r.read_all(), kv2)
    assert other.flush(10)
    for key, want in (("chunk:a", kv), ("chunk:b", kv2)):
        assert same(other.tier("memory").get(key), want) and same(other.tier("disk").get(key), want)
    other.check_integrity()

    redis_server.stop()
    other.put("chunk:c", make_kv(3))  # remote write fails in the background, never in the request
    assert other.flush(10)
    assert same(other.get("chunk:c"), make_kv(3)) and same(
        other.get("chunk:a"), kv
    )  # local tiers serve
    assert other.get("chunk:zzz") is None
    s = other.stats()
    assert s["redis"]["errors"] >= 1 and s["writer"]["failed"] == 0
    other.close()


def test_cli_reports_redis_tier(redis_server, tmp_path, capsys):
    import json

    from kvblend.cli import main

    _store(redis_server).put("chunk:a", make_kv())
    assert (
        main(["store", "stats", "--dir", str(tmp_path), "--redis-url", redis_server.url, "--json"])
        == 0
    )
    stats = json.loads(capsys.readouterr().out)
    assert (
        stats["redis"]["entries"] == 1
        and stats["redis"]["bytes"] > 0
        and stats["disk"]["entries"] == 0
    )
    assert main(["store", "clear", "--tier", "redis", "--redis-url", redis_server.url]) == 0
    assert _store(redis_server).get("chunk:a") is None
