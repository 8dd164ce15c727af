"""Chunk KV store: serializer, memory / disk / tiered tiers, readers, CLI. Redis lives in
test_store_redis.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import bits, kv_size, make_kv, run_python, same

from kvblend.config import StoreConfig
from kvblend.store.base import ChunkKV
from kvblend.store.disk import DiskStore
from kvblend.store.factory import create_store
from kvblend.store.memory import MemoryStore
from kvblend.store.reader import KVReadError
from kvblend.store.serializer import CorruptKVError, deserialize, parse_header, serialize

REPO = Path(__file__).resolve().parents[1]


# ---- serializer ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_serializer_roundtrip_bit_identical(dtype):
    kv = make_kv(dtype=dtype)
    kv.k[0, 0, 0, 0] = float("nan")
    kv.k[0, 0, 0, 1] = -0.0
    assert same(deserialize(serialize("chunk:a", kv), "chunk:a"), kv)


def test_serializer_layer_offsets_from_header():
    kv = make_kv(layers=5)
    blob = serialize("chunk:a", kv)
    header = parse_header(blob[:4096], "chunk:a")
    assert header.total_size == len(blob) and header.layer_shape == (2, 16, 8)
    from kvblend.store.serializer import decode_layer

    for layer in range(5):
        off, n = header.layer_span(layer)
        k, v = decode_layer(header, layer, blob[off : off + n])
        assert torch.equal(bits(k), bits(kv.k[layer])) and torch.equal(bits(v), bits(kv.v[layer]))


@pytest.mark.parametrize(
    "damage", ["flip_payload", "flip_header", "truncate", "extend", "magic", "empty"]
)
def test_serializer_rejects_damage(damage):
    blob = bytearray(serialize("chunk:a", make_kv()))
    if damage == "flip_payload":
        blob[-3] ^= 0x01
    elif damage == "flip_header":
        blob[20] ^= 0x01
    elif damage == "truncate":
        del blob[-1]
    elif damage == "extend":
        blob += b"\0"
    elif damage == "magic":
        blob[0:8] = b"PICKLE\0\0"
    else:
        blob = bytearray()
    with pytest.raises(CorruptKVError):
        deserialize(bytes(blob), "chunk:a")


def test_serializer_rejects_other_key():
    with pytest.raises(CorruptKVError, match="another key"):
        deserialize(serialize("chunk:a", make_kv()), "chunk:b")


# ---- memory tier ---------------------------------------------------------------------------------
def test_memory_lru_respects_budget():
    kv = make_kv()
    store = MemoryStore(max_bytes=3 * kv.nbytes)
    for i in range(3):
        store.put(f"k{i}", make_kv(i))
    assert store.get("k0") is not None  # k0 now most recent: k1 goes first
    store.put("k3", make_kv(3))
    store.check_integrity()
    assert (
        store.get("k1") is None
        and same(store.get("k0"), make_kv(0))
        and same(store.get("k3"), make_kv(3))
    )
    s = store.stats()
    assert (
        s["entries"] == 3
        and s["bytes"] == 3 * kv.nbytes <= s["budget_bytes"]
        and s["evictions"] == 1
    )
    store.put(
        "huge", make_kv(seq_len=100)
    )  # bigger than the whole budget: skipped, nothing evicted
    store.check_integrity()
    assert store.get("huge") is None and store.stats()["evictions"] == 1


def test_memory_does_not_pin_bigger_buffers():
    big = make_kv(seq_len=64)
    view = ChunkKV(big.k[:, :, :16], big.v[:, :, :16])
    store = MemoryStore()
    store.put("k", view)
    got = store.get("k")
    assert got.k.untyped_storage().nbytes() == got.k.numel() * 2
    store.check_integrity()
    assert same(got, ChunkKV(view.k.contiguous(), view.v.contiguous()))


# ---- disk tier -----------------------------------------------------------------------------------
def test_disk_roundtrip_survives_restart(tmp_path):
    store = DiskStore(tmp_path)
    kvs = {f"chunk:{i}": make_kv(i) for i in range(3)}
    for k, kv in kvs.items():
        store.put(k, kv)
    reopened = DiskStore(tmp_path)
    reopened.check_integrity()
    assert reopened.stats()["entries"] == 3
    for k, kv in kvs.items():
        assert same(reopened.get(k), kv)
    assert not list(tmp_path.glob(".tmp-*"))


def test_disk_budget_evicts_lru_and_restart_keeps_order(tmp_path):
    size = kv_size("chunk:0", make_kv(0))
    store = DiskStore(tmp_path, max_bytes=int(2.5 * size))
    store.put("chunk:0", make_kv(0))
    time.sleep(0.01)  # distinct mtimes: LRU order after restart comes from them
    store.put("chunk:1", make_kv(1))
    time.sleep(0.01)
    assert store.get("chunk:0") is not None  # bumps chunk:0 (memory and mtime)
    store.put("chunk:2", make_kv(2))
    store.check_integrity()
    assert store.stats()["evictions"] == 1 and not store.contains("chunk:1")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        store.path(k).name for k in ("chunk:0", "chunk:2")
    )
    reopened = DiskStore(
        tmp_path, max_bytes=int(1.5 * size)
    )  # smaller budget: the oldest (chunk:0) goes
    reopened.check_integrity()
    assert [k for k, _ in reopened.entries()] == ["chunk:2"] and not reopened.contains("chunk:0")


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "empty", "garbage"])
def test_disk_corrupt_file_is_a_counted_deleted_miss(tmp_path, damage):
    store = DiskStore(tmp_path)
    store.put("chunk:a", make_kv())
    path = store.path("chunk:a")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip_payload":
        data[-5] ^= 0x40
    elif damage == "flip_header":
        data[14] ^= 0x01
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"\x80\x04pickle?" * 100)
    path.write_bytes(bytes(data))
    assert store.get("chunk:a") is None and not path.exists()
    path.write_bytes(bytes(data))
    reader = store.open("chunk:a")  # payload damage surfaces only when that layer is read
    if reader is not None:
        with pytest.raises(KVReadError):
            reader.read_all()
        reader.close()
    assert not path.exists()
    s = store.stats()
    assert s["corrupt"] == 2 and s["misses"] >= 1
    store.check_integrity()
    assert s["entries"] == 0 and s["bytes"] == 0


def test_disk_layerwise_reader_detects_corrupt_layer(tmp_path):
    store = DiskStore(tmp_path)
    kv = make_kv(layers=4)
    store.put("chunk:a", kv)
    path = store.path("chunk:a")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01  # last layer's v
    path.write_bytes(bytes(data))
    with store.open("chunk:a") as reader:  # header is fine: opening succeeds
        for layer in range(3):
            k, v = reader.read_layer(layer)
            assert torch.equal(bits(k), bits(kv.k[layer])) and torch.equal(
                bits(v), bits(kv.v[layer])
            )
        with pytest.raises(KVReadError, match="checksum"):
            reader.read_layer(3)
    assert not path.exists() and store.stats()["corrupt"] == 1


def test_disk_removes_only_stale_temp_files(tmp_path):
    stale, fresh = tmp_path / ".tmp-1-stale", tmp_path / ".tmp-2-fresh"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    DiskStore(tmp_path)
    assert (
        not stale.exists() and fresh.exists()
    )  # a fresh one may be another process's write in flight


def test_disk_adopts_files_written_by_another_process(tmp_path):
    """Two processes on one directory (template for the engine-level sharing test)."""
    kv = make_kv(7)
    reader_store = DiskStore(tmp_path)  # exists before the other process writes
    run_python(
        f"""
        from kvblend.store.disk import DiskStore
        from helpers import make_kv
        DiskStore({str(tmp_path)!r}).put("chunk:shared", make_kv(7))
    """,
        env={"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"},
    )
    assert same(reader_store.get("chunk:shared"), kv)
    reader_store.check_integrity()
    assert reader_store.stats()["entries"] == 1


# ---- concurrency ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tiers", [("memory",), ("disk",), ("memory", "disk")])
def test_concurrent_readers_and_writers_never_see_torn_kv(tmp_path, tiers):
    """Two different values of different sizes fight over one key (forcing real replacements) while
    other keys churn the budget; every read must be exactly one of the two values, or a miss."""
    a, b = make_kv(1, seq_len=16), make_kv(2, seq_len=17)
    budget = 4 * kv_size("chunk:x", b)
    store = create_store(
        StoreConfig(
            tiers=tiers,
            disk_dir=tmp_path,
            memory_bytes=budget,
            disk_bytes=budget,
            disk_fsync=False,
            async_writes=False,
        )
    )
    stop = threading.Event()
    errors: list[str] = []

    def writer(kv: ChunkKV, churn: int) -> None:
        i = 0
        while not stop.is_set():
            for t in store.tiers:  # bypass "same size exists" dedup: clear then write
                if isinstance(t, DiskStore):
                    t.path("chunk:x").unlink(missing_ok=True)
            store.put("chunk:x", kv)
            store.put(f"chunk:churn{churn}-{i % 5}", make_kv(10 + i % 5))
            i += 1

    def reader() -> None:
        while not stop.is_set():
            got = store.get("chunk:x")
            if got is not None and not (same(got, a) or same(got, b)):
                errors.append("torn read")
            r = store.open("chunk:x")
            if r is not None:
                try:
                    got = r.read_all()
                    if not (same(got, a) or same(got, b)):
                        errors.append("torn layerwise read")
                except KVReadError:
                    pass  # the entry vanished mid-read: a miss, allowed
                finally:
                    r.close()

    threads = [
        threading.Thread(target=writer, args=(a, 0)),
        threading.Thread(target=writer, args=(b, 1)),
        threading.Thread(target=reader),
        threading.Thread(target=reader),
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    store.check_integrity()
    assert all(s.get("corrupt", 0) == 0 for s in store.stats().values())


# ---- tiered + factory ----------------------------------------------------------------------------
def test_tiered_roundtrip_and_promotion_from_disk(tmp_path):
    cfg = StoreConfig(tiers=("memory", "disk"), disk_dir=tmp_path)
    kv = make_kv()
    first = create_store(cfg)
    first.put("chunk:a", kv)
    first.put("chunk:b", make_kv(5))
    assert first.flush(10)
    assert same(first.get("chunk:a"), kv) and first.stats()["memory"]["hits"] == 1
    first.close()

    second = create_store(cfg)  # restart: memory empty, disk warm
    assert same(second.get("chunk:a"), kv)
    assert second.flush(10) and second.tier("memory").contains("chunk:a")
    with second.open("chunk:b") as reader:  # streamed hit: promoted after the last layer
        assert same(reader.read_all(), make_kv(5))
    assert second.flush(10) and same(second.tier("memory").get("chunk:b"), make_kv(5))
    s = second.stats()
    assert s["disk"]["hits"] == 2 and s["memory"]["misses"] == 2 and s["writer"]["failed"] == 0
    second.check_integrity()
    second.close()


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_reader_layers_match(tmp_path, tier):
    store = create_store(StoreConfig(tiers=(tier,), disk_dir=tmp_path, async_writes=False))
    kv = make_kv(3, layers=6)
    store.put("chunk:a", kv)
    assert store.open("chunk:missing") is None
    with store.open("chunk:a") as r:
        assert (r.num_layers, r.kv_heads, r.seq_len, r.head_dim, r.dtype) == (
            6,
            2,
            16,
            8,
            torch.bfloat16,
        )
        for layer in reversed(range(6)):  # any order
            k, v = r.read_layer(layer)
            assert torch.equal(bits(k), bits(kv.k[layer])) and torch.equal(
                bits(v), bits(kv.v[layer])
            )


def test_store_config_validation():
    with pytest.raises(ValueError):
        StoreConfig(tiers=("memory", "memory"))
    with pytest.raises(ValueError):
        StoreConfig(tiers=("s3",))
    with pytest.raises(ValueError):
        StoreConfig(memory_bytes=-1)
    assert StoreConfig().disk_dir.name == "kv"


def test_background_writer_drops_instead_of_blocking():
    from kvblend.store.writer import BackgroundWriter

    gate = threading.Event()
    w = BackgroundWriter(max_pending_bytes=10)
    assert w.submit(gate.wait, 8)  # first job always admitted
    assert not w.submit(lambda: None, 8)  # would exceed the bound: dropped, not queued
    gate.set()
    assert w.flush(5) and w.stats()["dropped"] == 1 and w.stats()["done"] == 1
    w.close()


# ---- CLI -----------------------------------------------------------------------------------------
def test_cli_stats_ls_clear(tmp_path, capsys):
    from kvblend.cli import main

    store = DiskStore(tmp_path)
    store.put("chunk:a", make_kv())
    store.put("chunk:b", make_kv(1))
    store.path("chunk:b").write_bytes(b"junk")
    assert main(["store", "stats", "--dir", str(tmp_path), "--verify", "--json"]) == 0
    import json

    stats = json.loads(capsys.readouterr().out)["disk"]
    assert stats["entries"] == 1 and stats["corrupt"] == 1 and stats["hits"] == 1
    assert main(["store", "ls", "--dir", str(tmp_path)]) == 0
    assert "chunk:a" in capsys.readouterr().out
    assert main(["store", "clear", "--dir", str(tmp_path)]) == 0
    assert not list(tmp_path.glob("*.kvb"))
