"""Layer-by-layer readers over stored KV, so loading layer i+1 can overlap computing layer i.

Contract of every ``KVReader``:
- ``read_layer(i)`` -> (k, v), each [kv_heads, L, d], in memory the caller may keep;
- ``read_layer_into(i, k_out, v_out)`` writes the same values into caller buffers (views allowed);
- ``read_layer_bytes_into(i, k_out, v_out)`` is the same into uint8 numpy views of CPU buffers
  [kv_heads, L, d * itemsize]: the loader's per-layer path, free of torch dispatch per copy;
- a layer is verified before it is handed out; if the entry turns out corrupt, truncated, evicted
  or unreachable mid-read, ``KVReadError`` is raised and the caller must treat the chunk as a miss;
- a reader is used by one thread at a time; ``close()`` releases its file / connection.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch

from kvblend.store.chunk import ChunkKV
from kvblend.store.serializer import CorruptKVError, KVHeader, byte_view, copy_layer_bytes_into


class KVReadError(Exception):
    """The entry could not be read completely and correctly (corrupt, vanished, remote down)."""


class KVReader(ABC):
    num_layers: int
    kv_heads: int
    seq_len: int
    head_dim: int
    dtype: torch.dtype

    @abstractmethod
    def read_layer_bytes_into(self, layer: int, k_out: np.ndarray, v_out: np.ndarray) -> None:
        """Copy layer ``layer``'s raw bytes into k_out / v_out, uint8 [kv_heads, L, d * itemsize]
        (the last axis unit-stride). Raises KVReadError."""

    def read_layer_into(self, layer: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Copy layer ``layer`` into k_out / v_out [kv_heads, L, d]. Raises KVReadError."""
        shape = (self.kv_heads, self.seq_len, self.head_dim)
        for out in (k_out, v_out):
            if tuple(out.shape) != shape or out.dtype != self.dtype:  # caller bug: not a read error
                raise ValueError(
                    f"layer buffers must be {shape} {self.dtype}, got "
                    f"{tuple(out.shape)} {out.dtype}"
                )
        if k_out.device.type == "cpu" and v_out.device.type == "cpu":
            self.read_layer_bytes_into(layer, byte_view(k_out), byte_view(v_out))
        else:  # device buffers: read into host memory, then one transfer each
            k, v = self.read_layer(layer)
            k_out.copy_(k)
            v_out.copy_(v)

    def read_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer, each [kv_heads, L, d], in fresh host memory. Raises KVReadError."""
        k = torch.empty((self.kv_heads, self.seq_len, self.head_dim), dtype=self.dtype)
        v = torch.empty_like(k)
        self.read_layer_bytes_into(layer, byte_view(k), byte_view(v))
        return k, v

    def read_all(self) -> ChunkKV:
        """Every layer, as one ChunkKV [layers, kv_heads, L, d]."""
        k = torch.empty(
            (self.num_layers, self.kv_heads, self.seq_len, self.head_dim), dtype=self.dtype
        )
        v = torch.empty_like(k)
        for layer in range(self.num_layers):
            self.read_layer_into(layer, k[layer], v[layer])
        return ChunkKV(k, v)

    def close(self) -> None:
        pass

    def __enter__(self) -> "KVReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TensorReader(KVReader):
    """Over tensors already in memory: ``read_layer`` returns views (no copy) — treat
    them as read-only."""

    def __init__(self, kv: ChunkKV):
        self._kv = kv
        self.num_layers, self.kv_heads, self.seq_len, self.head_dim = kv.k.shape
        self.dtype = kv.k.dtype
        # Byte views made once: per-layer copies are then numpy slicing + memcpy (loads run on a
        # loader thread, where torch's copy pays OpenMP team start-up per call).
        self._k_bytes = self._v_bytes = None
        if kv.k.device.type == "cpu":
            self._k_bytes, self._v_bytes = byte_view(kv.k), byte_view(kv.v)

    def read_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv.k[layer], self._kv.v[layer]

    def read_layer_bytes_into(self, layer: int, k_out: np.ndarray, v_out: np.ndarray) -> None:
        if self._k_bytes is None:
            k_out[...] = byte_view(self._kv.k[layer].cpu())
            v_out[...] = byte_view(self._kv.v[layer].cpu())
            return
        np.copyto(k_out, self._k_bytes[layer])
        np.copyto(v_out, self._v_bytes[layer])


# Fetches ``length`` bytes at ``offset`` of the stored blob; returns fewer if the blob is shorter.
RangeFetch = Callable[[int, int], bytes]


class BlobReader(KVReader):
    """Over a serialized blob reachable by byte ranges (a file, a Redis value, bytes in memory).

    One class for every byte-backed tier: the tier supplies ``fetch`` (pread / GETRANGE / slicing)
    and optional hooks; this class owns decoding and verification so no backend re-implements them.
    ``on_corrupt`` runs once if a layer fails verification (the disk tier deletes the file there).
    """

    def __init__(
        self,
        header: KVHeader,
        fetch: RangeFetch,
        *,
        on_corrupt: Callable[[], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ):
        self.header = header
        self.num_layers, self.kv_heads = header.num_layers, header.kv_heads
        self.seq_len, self.head_dim, self.dtype = header.seq_len, header.head_dim, header.dtype
        self._fetch, self._on_corrupt, self._on_close = fetch, on_corrupt, on_close
        self._on_done: Callable[[list[bytes]], None] | None = None
        self._parts: dict[int, bytes] | None = None
        self._closed = False
        self.failed = False  # a read raised KVReadError: the engine recomputes this entry

    def read_layer_bytes_into(self, layer: int, k_out: np.ndarray, v_out: np.ndarray) -> None:
        if (
            self._closed
        ):  # the fd / connection behind ``fetch`` may already belong to something else
            raise KVReadError("reader is closed")
        off, n = self.header.layer_span(layer)
        try:
            raw = self._fetch(off, n)
            copy_layer_bytes_into(self.header, layer, raw, k_out, v_out)
        except CorruptKVError as e:
            self.failed = True
            self._corrupt()
            raise KVReadError(str(e)) from e
        except (
            OSError,
            ValueError,
        ) as e:  # file closed / vanished, remote down (tiers map theirs to OSError)
            self.failed = True
            raise KVReadError(f"layer {layer}: {e}") from e
        self._collect(layer, raw)

    def on_complete(self, callback: Callable[[list[bytes]], None]) -> None:
        """Keep each verified layer's raw bytes; after the last layer, call
        ``callback(parts)`` once.

        Lets a tiered store promote an entry it is streaming without fetching it a second time.
        """
        self._on_done, self._parts = callback, {}

    def _collect(self, layer: int, raw: bytes) -> None:
        if self._parts is None:
            return
        self._parts[layer] = raw
        if len(self._parts) == self.num_layers:
            parts, self._parts = [self._parts[i] for i in range(self.num_layers)], None
            if self._on_done is not None:
                self._on_done(parts)

    def _corrupt(self) -> None:
        cb, self._on_corrupt = self._on_corrupt, None
        self._parts = None
        if cb is not None:
            cb()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._on_close is not None:
                self._on_close()
