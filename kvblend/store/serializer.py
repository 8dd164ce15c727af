"""ChunkKV <-> bytes, without pickle: a versioned header, then raw tensor bytes layer by layer.

Layout (little endian)::

    fixed header  magic "KVBLEND\\0", version u16, dtype u8, pad u8, num_layers u32, kv_heads u32,
                  seq_len u32, head_dim u32, key_tag 16 bytes
    layer_crcs    num_layers x u32   crc32 of layer l's payload (k_l bytes then v_l bytes)
    header_crc    u32                crc32 of everything above
    payload       for l in layers: k[l] [kv_heads, L, d], then v[l] [kv_heads, L, d], C order

Every offset follows from the header, so a reader can fetch and verify one layer at a time
(``layer_span``) — that is what lets loading overlap compute. Per-layer checksums (rather than one
over the blob) mean a layerwise reader never hands out a layer it has not verified.
``key_tag`` binds a blob to its key, so a file or value stored under the wrong name is a miss too.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from kvblend.store.chunk import ChunkKV

MAGIC = b"KVBLEND\0"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sHBBIIII16s")
_U32 = struct.Struct("<I")

_DTYPE_CODES: dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_CODE_DTYPES = {c: d for d, c in _DTYPE_CODES.items()}

if sys.byteorder != "little":  # raw tensor bytes are written in native order
    raise ImportError("kvblend.store.serializer supports little-endian hosts only")


class CorruptKVError(Exception):
    """Bytes that do not decode to the KV they claim to be (bad magic, version,
    size, checksum, key)."""


def key_tag(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class KVHeader:
    """Geometry of one serialized ChunkKV; all offsets are in bytes from the blob start."""

    dtype: torch.dtype
    num_layers: int
    kv_heads: int
    seq_len: int
    head_dim: int
    tag: bytes
    layer_crcs: tuple[int, ...]

    @property
    def header_size(self) -> int:
        return header_size(self.num_layers)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one [kv_heads, L, d] tensor (k_l or v_l)."""
        return self.kv_heads * self.seq_len * self.head_dim * _itemsize(self.dtype)

    @property
    def total_size(self) -> int:
        return self.header_size + 2 * self.num_layers * self.tensor_bytes

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        return (self.kv_heads, self.seq_len, self.head_dim)

    def layer_span(self, layer: int) -> tuple[int, int]:
        """(offset, length) of layer ``layer``'s payload: k_l followed by v_l."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        n = 2 * self.tensor_bytes
        return self.header_size + layer * n, n


def header_size(num_layers: int) -> int:
    return _FIXED.size + 4 * num_layers + 4


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _raw(t: torch.Tensor) -> memoryview:
    """Bytes of ``t``: zero-copy for a contiguous CPU tensor, one transfer for a device tensor (bf16
    has no numpy dtype, so go through uint8)."""
    return memoryview(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def serialize_parts(key: str, kv: ChunkKV) -> list[memoryview | bytes]:
    """Header followed by the payload buffers in file order; join them or write them one by one.

    The buffers alias ``kv``'s memory: keep ``kv`` alive and unmodified until they are written.
    """
    k, v = kv.k.detach().cpu().contiguous(), kv.v.detach().cpu().contiguous()
    if k.dtype not in _DTYPE_CODES or v.dtype != k.dtype:
        raise ValueError(
            f"unsupported KV dtype {k.dtype}/{v.dtype}; expected one of {list(_DTYPE_CODES)}"
        )
    layers, heads, seq_len, head_dim = k.shape
    payload: list[memoryview] = []
    crcs: list[int] = []
    for layer in range(layers):
        kb, vb = _raw(k[layer]), _raw(v[layer])
        crcs.append(zlib.crc32(vb, zlib.crc32(kb)))
        payload += [kb, vb]
    head = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        _DTYPE_CODES[k.dtype],
        0,
        layers,
        heads,
        seq_len,
        head_dim,
        key_tag(key),
    )
    head += b"".join(_U32.pack(c) for c in crcs)
    head += _U32.pack(zlib.crc32(head))
    return [head, *payload]


def serialize(key: str, kv: ChunkKV) -> bytes:
    return b"".join(serialize_parts(key, kv))


def parse_header(buf: bytes | memoryview, key: str | None = None) -> KVHeader:
    """Decode and verify the header at the start of ``buf`` (which may hold just the header).

    Raises CorruptKVError on any mismatch, including a key tag that is not ``key``'s.
    """
    buf = memoryview(buf)
    if len(buf) < _FIXED.size:
        raise CorruptKVError(f"blob too short for a header ({len(buf)} bytes)")
    magic, version, dcode, _, layers, heads, seq_len, head_dim, tag = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptKVError("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptKVError(f"unsupported format version {version}")
    if dcode not in _CODE_DTYPES:
        raise CorruptKVError(f"unknown dtype code {dcode}")
    size = header_size(layers)
    if len(buf) < size:
        raise CorruptKVError("blob too short for its layer table")
    (hcrc,) = _U32.unpack_from(buf, size - 4)
    if zlib.crc32(buf[: size - 4]) != hcrc:
        raise CorruptKVError("header checksum mismatch")
    if key is not None and tag != key_tag(key):
        raise CorruptKVError("blob belongs to another key")
    crcs = tuple(_U32.unpack_from(buf, _FIXED.size + 4 * i)[0] for i in range(layers))
    return KVHeader(_CODE_DTYPES[dcode], layers, heads, seq_len, head_dim, tag, crcs)


def _verify_layer(header: KVHeader, layer: int, raw: bytes | bytearray | memoryview) -> None:
    _, n = header.layer_span(layer)
    if len(raw) != n:
        raise CorruptKVError(f"layer {layer}: got {len(raw)} bytes, expected {n} (truncated?)")
    if zlib.crc32(raw) != header.layer_crcs[layer]:
        raise CorruptKVError(f"layer {layer}: checksum mismatch")


def byte_view(t: torch.Tensor) -> np.ndarray:
    """Writable uint8 numpy view of CPU tensor ``t`` [..., d] -> [..., d * itemsize] (last dim
    unit-stride; the others may be strided, e.g. a row range of a prompt buffer)."""
    return t.view(torch.uint8).numpy()


def copy_layer_into(
    header: KVHeader,
    layer: int,
    raw: bytes | bytearray | memoryview,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
) -> None:
    """Verify layer ``layer``'s payload bytes, then copy them into k_out / v_out [kv_heads, L, d].

    The outputs may be strided views (e.g. rows [off, off+L) of a [kv_heads, T, d] buffer); nothing
    is written before the checksum passes. Raises CorruptKVError. Copies go through numpy so no
    torch tensor ever aliases read-only memory (bytes from redis, mmaps).
    """
    for out in (k_out, v_out):
        if tuple(out.shape) != header.layer_shape or out.dtype != header.dtype:
            raise ValueError(
                f"layer buffers must be {header.layer_shape} {header.dtype}, got "
                f"{tuple(out.shape)} {out.dtype}"
            )
    copy_layer_bytes_into(header, layer, raw, byte_view(k_out), byte_view(v_out))


def copy_layer_bytes_into(
    header: KVHeader,
    layer: int,
    raw: bytes | bytearray | memoryview,
    k_out: np.ndarray,
    v_out: np.ndarray,
) -> None:
    """``copy_layer_into`` for uint8 views [kv_heads, L, d * itemsize] of the output buffers."""
    _verify_layer(header, layer, raw)
    row_bytes = header.head_dim * _itemsize(header.dtype)
    shape = (header.kv_heads, header.seq_len, row_bytes)
    if k_out.shape != shape or v_out.shape != shape:
        raise ValueError(f"layer byte buffers must be {shape}, got {k_out.shape}, {v_out.shape}")
    half = len(raw) // 2
    if half == 0:
        return
    src = np.frombuffer(raw, dtype=np.uint8)
    np.copyto(k_out, src[:half].reshape(shape))
    np.copyto(v_out, src[half:].reshape(shape))


def decode_layer(
    header: KVHeader, layer: int, raw: bytes | bytearray | memoryview
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verified (k, v), each [kv_heads, L, d], in fresh memory. Raises CorruptKVError."""
    k = torch.empty(header.layer_shape, dtype=header.dtype)
    v = torch.empty_like(k)
    copy_layer_into(header, layer, raw, k, v)
    return k, v


def deserialize(blob: bytes | bytearray | memoryview, key: str | None = None) -> ChunkKV:
    """Blob -> ChunkKV with k, v [layers, kv_heads, L, d] in fresh memory. Raises CorruptKVError."""
    header = parse_header(blob, key)
    if len(blob) != header.total_size:
        raise CorruptKVError(f"blob is {len(blob)} bytes, header says {header.total_size}")
    mv = memoryview(blob)
    return assemble(
        header, [mv[off : off + n] for off, n in map(header.layer_span, range(header.num_layers))]
    )


HEADER_PROBE = (
    4096  # one fetch of this many bytes covers the header of any model up to ~1000 layers
)


def read_header(fetch, key: str | None = None, first: bytes | None = None) -> KVHeader:
    """Fetch and verify just the header through ``fetch(offset, length) -> bytes`` (a range reader).

    ``first``: the blob's first HEADER_PROBE bytes if the caller already has them; deeper models
    cost a second, exact fetch. Raises CorruptKVError.
    """
    if first is None:
        first = fetch(0, HEADER_PROBE)
    if len(first) < _FIXED.size:
        raise CorruptKVError(f"blob too short for a header ({len(first)} bytes)")
    layers = _FIXED.unpack_from(first, 0)[4]
    need = header_size(layers)
    if need > len(first):
        first = fetch(0, need)
    return parse_header(first, key)


def assemble(header: KVHeader, parts: list[bytes]) -> ChunkKV:
    """ChunkKV [layers, kv_heads, L, d] from every layer's payload (as a layerwise
    reader fetched them)."""
    k = torch.empty((header.num_layers, *header.layer_shape), dtype=header.dtype)
    v = torch.empty_like(k)
    for layer, raw in enumerate(parts):
        copy_layer_into(header, layer, raw, k[layer], v[layer])
    return ChunkKV(k, v)
