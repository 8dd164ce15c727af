"""LayerwiseLoader (kvblend/engine/kv_loader.py): pipelined fill == synchronous fill;
errors and ordering."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import bits, make_kv

from kvblend.config import StoreConfig
from kvblend.engine.kv_loader import LayerwiseLoader, load_sync
from kvblend.store.factory import create_store
from kvblend.store.reader import KVReader, KVReadError, TensorReader

LAYERS, HEADS, DIM = 6, 2, 8


class GatedReader(KVReader):
    """Wraps a reader; blocks before ``gate_layer`` until released, or fails at ``fail_layer``."""

    def __init__(
        self, inner: KVReader, gate_layer: int | None = None, fail_layer: int | None = None
    ):
        self.inner, self.gate_layer, self.fail_layer = inner, gate_layer, fail_layer
        self.num_layers, self.kv_heads, self.seq_len = (
            inner.num_layers,
            inner.kv_heads,
            inner.seq_len,
        )
        self.head_dim, self.dtype = inner.head_dim, inner.dtype
        self.release = threading.Event()

    def read_layer_bytes_into(self, layer, k_out, v_out):
        if layer == self.gate_layer:
            self.release.wait(10)
        if layer == self.fail_layer:
            raise KVReadError("simulated corrupt layer")
        self.inner.read_layer_bytes_into(layer, k_out, v_out)


def _buffers(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k_pre, v [layers, heads, rows, dim] pre-filled with a sentinel to catch stray writes."""
    k = torch.full((LAYERS, HEADS, rows, DIM), 7.0, dtype=torch.bfloat16)
    return k, k.clone()


def test_pipelined_fill_equals_synchronous_fill(tmp_path):
    store = create_store(
        StoreConfig(tiers=("memory", "disk"), disk_dir=tmp_path, async_writes=False)
    )
    lens = [16, 5, 11]
    kvs = [make_kv(i, layers=LAYERS, heads=HEADS, seq_len=n, dim=DIM) for i, n in enumerate(lens)]
    for i, kv in enumerate(kvs):
        (store.tier("disk") if i else store).put(
            f"chunk:{i}", kv
        )  # chunk 0 in memory + disk, others disk only
    offsets, rows = (
        [3, 3 + 16 + 4, 3 + 16 + 4 + 5],
        3 + 16 + 4 + 5 + 11 + 2,
    )  # gaps = question / prefix rows

    def sources():
        return [(store.open(f"chunk:{i}"), off) for i, off in enumerate(offsets)]

    k_sync, v_sync = _buffers(rows)
    load_sync(sources(), k_sync, v_sync)
    k_pipe, v_pipe = _buffers(rows)
    with LayerwiseLoader(sources(), k_pipe, v_pipe, close_readers=True) as loader:
        for layer in range(LAYERS):
            loader.wait_layer(layer)
    assert torch.equal(bits(k_pipe), bits(k_sync)) and torch.equal(bits(v_pipe), bits(v_sync))
    for kv, off in zip(kvs, offsets):
        assert torch.equal(bits(k_pipe[:, :, off : off + kv.seq_len]), bits(kv.k))
        assert torch.equal(bits(v_pipe[:, :, off : off + kv.seq_len]), bits(kv.v))
    assert (
        (k_pipe[:, :, :3] == 7).all()
        and (k_pipe[:, :, 19:23] == 7).all()
        and (v_pipe[:, :, -2:] == 7).all()
    )
    store.close()


def test_wait_layer_returns_while_later_layers_still_loading():
    kv = make_kv(layers=LAYERS, heads=HEADS, seq_len=4, dim=DIM)
    reader = GatedReader(TensorReader(kv), gate_layer=3)
    k, v = _buffers(4)
    with LayerwiseLoader([(reader, 0)], k, v) as loader:
        loader.wait_layer(2, timeout=5)  # layers 0..2 usable while 3 is still "in flight"
        assert torch.equal(bits(k[2]), bits(kv.k[2]))
        with pytest.raises(TimeoutError):
            loader.wait_layer(3, timeout=0.05)
        reader.release.set()
        loader.wait_all(timeout=5)
    assert torch.equal(bits(k), bits(kv.k)) and torch.equal(bits(v), bits(kv.v))


def test_failure_mid_load_surfaces_from_that_layer_on():
    kv = make_kv(layers=LAYERS, heads=HEADS, seq_len=4, dim=DIM)
    k, v = _buffers(8)
    sources = [(TensorReader(kv), 0), (GatedReader(TensorReader(kv), fail_layer=3), 4)]
    with LayerwiseLoader(sources, k, v) as loader:
        loader.wait_layer(2, timeout=5)
        for layer in (3, LAYERS - 1):
            with pytest.raises(KVReadError):
                loader.wait_layer(layer, timeout=5)
        assert isinstance(loader.error, KVReadError)


def test_one_thread_failing_does_not_cut_short_the_others():
    """The loader's threads split the chunks; one failing at layer 3 must not stop another thread
    from delivering layers 0..2, even when that thread is behind."""
    kv = make_kv(layers=LAYERS, heads=HEADS, seq_len=4, dim=DIM)
    k, v = _buffers(8)
    behind = GatedReader(TensorReader(kv), gate_layer=0)
    with LayerwiseLoader(
        [(behind, 0), (GatedReader(TensorReader(kv), fail_layer=3), 4)], k, v
    ) as loader:
        with pytest.raises(KVReadError):
            loader.wait_layer(3, timeout=5)  # the other thread has failed
        behind.release.set()
        loader.wait_layer(2, timeout=5)
    assert torch.equal(bits(k[:3, :, :4]), bits(kv.k[:3])) and torch.equal(
        bits(v[:3, :, 4:]), bits(kv.v[:3])
    )


def test_close_before_done_does_not_hang_and_rejects_bad_geometry():
    kv = make_kv(layers=LAYERS, heads=HEADS, seq_len=4, dim=DIM)
    reader = GatedReader(TensorReader(kv), gate_layer=1)
    k, v = _buffers(4)
    loader = LayerwiseLoader([(reader, 0)], k, v)
    reader.release.set()
    loader.close()
    with pytest.raises(ValueError):
        LayerwiseLoader([(TensorReader(kv), 2)], k, v)  # rows 2..6 do not fit in 4
    with pytest.raises(ValueError):
        LayerwiseLoader(
            [(TensorReader(make_kv(layers=2, heads=HEADS, seq_len=4, dim=DIM)), 0)], k, v
        )
