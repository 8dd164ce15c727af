"""Layer-by-layer loading of stored chunk KV into a request's buffers, overlapped with compute.

The blender computes layer i while this loader's thread fills layer i+1, ... It calls
``wait_layer(i)`` right before it needs layer i's stored KV.

    k_pre = torch.empty(layers, kv_heads, T, d, dtype=...)   # pre-RoPE keys of the whole prompt
    v     = torch.empty_like(k_pre)
    with LayerwiseLoader([(reader_a, 0), (reader_b, 512)], k_pre, v) as loader:
        for i in range(layers):
            loader.wait_layer(i)        # rows of every chunk are filled for layer i
            ...compute layer i...

A reader failing mid-load (corrupt entry, remote gone) makes ``wait_layer`` raise KVReadError for
that layer and every later one; the caller falls back to computing those chunks (they were a miss).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvblend.store.reader import KVReader, KVReadError
from kvblend.store.serializer import byte_view

Source = tuple[KVReader, int]  # (reader of one chunk, first destination row of that chunk)


def _check_sources(sources: Sequence[Source], k_pre: torch.Tensor, v: torch.Tensor) -> None:
    if k_pre.shape != v.shape or k_pre.dim() != 4:
        raise ValueError(
            "k_pre and v must share one shape [layers, kv_heads, T, d]; "
            f"got {tuple(k_pre.shape)}, {tuple(v.shape)}"
        )
    layers, heads, rows, dim = k_pre.shape
    for reader, off in sources:
        if (reader.num_layers, reader.kv_heads, reader.head_dim) != (
            layers,
            heads,
            dim,
        ) or reader.dtype != k_pre.dtype:
            raise ValueError(
                "reader geometry "
                f"{(reader.num_layers, reader.kv_heads, reader.head_dim, reader.dtype)} "
                f"does not match buffers {(layers, heads, dim, k_pre.dtype)}"
            )
        if not 0 <= off <= rows - reader.seq_len:
            raise ValueError(
                f"chunk rows [{off}, {off + reader.seq_len}) outside the buffer's {rows} rows"
            )


def load_layer(sources: Sequence[Source], k_pre: torch.Tensor, v: torch.Tensor, layer: int) -> None:
    """Copy layer ``layer`` of every source into rows [off, off+L) of
    k_pre / v [layers, kv_heads, T, d]."""
    for reader, off in sources:
        rows = slice(off, off + reader.seq_len)
        reader.read_layer_into(layer, k_pre[layer, :, rows], v[layer, :, rows])


class _LayerCopier:
    """``load_layer`` with the buffers' uint8 numpy views made once: per chunk and layer only numpy
    slicing and a memcpy are left (torch slicing + view per copy cost as much as the copy itself
    for ~500-token chunks). Device buffers take the tensor path."""

    def __init__(self, sources: Sequence[Source], k_pre: torch.Tensor, v: torch.Tensor):
        self.sources, self.k_pre, self.v = sources, k_pre, v
        self._bytes = None
        if k_pre.device.type == "cpu" and v.device.type == "cpu":
            self._bytes = (byte_view(k_pre), byte_view(v))  # [layers, kv_heads, T, d * itemsize]

    def __call__(self, layer: int) -> None:
        if self._bytes is None:
            load_layer(self.sources, self.k_pre, self.v, layer)
            return
        k_bytes, v_bytes = self._bytes[0][layer], self._bytes[1][layer]
        for reader, off in self.sources:
            end = off + reader.seq_len
            reader.read_layer_bytes_into(layer, k_bytes[:, off:end], v_bytes[:, off:end])


def load_sync(sources: Sequence[Source], k_pre: torch.Tensor, v: torch.Tensor) -> None:
    """Everything, on the calling thread (reference for the pipelined path; fallback when not
    overlapping)."""
    _check_sources(sources, k_pre, v)
    copy = _LayerCopier(sources, k_pre, v)
    for layer in range(k_pre.shape[0]):
        copy(layer)


class LayerwiseLoader:
    """Fills k_pre / v [layers, kv_heads, T, d] layer by layer on background threads.

    Contract: after ``wait_layer(i)`` returns, layer i of every source's rows is in place and will
    not be written again; rows not covered by a source are never touched. The loader does not own
    the readers' lifetimes unless ``close_readers`` (then ``close()`` closes them).

    ``num_threads`` threads split the sources (each reader stays on one thread, as readers require)
    and go through the layers in order; a layer is ready when every thread has copied its share. One
    thread copies at about single-core memcpy speed; two reach about what a two-core memcpy does.
    """

    def __init__(
        self,
        sources: Sequence[Source],
        k_pre: torch.Tensor,
        v: torch.Tensor,
        *,
        start: bool = True,
        close_readers: bool = False,
        num_threads: int = 2,
    ):
        _check_sources(sources, k_pre, v)
        self.sources, self.k_pre, self.v = list(sources), k_pre, v
        self.num_layers = k_pre.shape[0]
        self._ready = [threading.Event() for _ in range(self.num_layers)]
        self._error: BaseException | None = None
        self._failed_layer = self.num_layers  # layers >= this one were not loaded
        self._stop = threading.Event()
        self._close_readers = close_readers
        num_threads = max(1, min(num_threads, len(self.sources)))
        shares = [self.sources[i::num_threads] for i in range(num_threads)]  # one thread per reader
        self._lock = threading.Lock()
        self._pending = [len(shares)] * self.num_layers  # threads still copying each layer
        self._threads = [
            threading.Thread(
                target=self._run, args=(share,), name=f"kvblend-kv-loader-{i}", daemon=True
            )
            for i, share in enumerate(shares)
        ]
        if start:
            self.start()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _run(self, share: list[Source]) -> None:
        layer = 0
        # Inference mode is thread-local: buffers allocated under it can only be written under it.
        try:
            with torch.inference_mode(torch.is_inference(self.k_pre)):
                copy = _LayerCopier(share, self.k_pre, self.v)
                for layer in range(self.num_layers):
                    if self._stop.is_set():
                        raise KVReadError("loader closed before layer was loaded")
                    if layer >= self._failed_layer:  # another thread failed at or before this layer
                        return
                    copy(layer)
                    with self._lock:
                        self._pending[layer] -= 1
                        done = self._pending[layer] == 0
                    if done:
                        self._ready[layer].set()
        except BaseException as e:  # surfaced to the consumer through wait_layer
            # Not a stop for the other threads: layers before this one must still complete.
            with self._lock:
                if layer < self._failed_layer:
                    self._error, self._failed_layer = e, layer
            for ev in self._ready[layer:]:
                ev.set()  # wake every waiter; they see the error

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until layer ``layer`` is loaded. Raises KVReadError if it never will be,
        TimeoutError on timeout."""
        if not self._ready[layer].wait(timeout):
            raise TimeoutError(f"layer {layer} not loaded within {timeout}s")
        if layer >= self._failed_layer:
            err = self._error
            if isinstance(err, KVReadError):
                raise err
            raise KVReadError(f"loading layer {layer} failed: {err!r}") from err

    def wait_all(self, timeout: float | None = None) -> None:
        self.wait_layer(self.num_layers - 1, timeout)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def close(self) -> None:
        """Stop after the layer in flight, join the threads, and close readers if owned.
        Idempotent."""
        self._stop.set()
        for thread in self._threads:
            if thread.ident is not None:
                thread.join()
        if self._close_readers:
            for reader, _ in self.sources:
                reader.close()
            self._close_readers = False

    def __enter__(self) -> "LayerwiseLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
