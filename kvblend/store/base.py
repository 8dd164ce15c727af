"""The narrow interface between the engine and wherever chunk KV lives.

The engine only ever calls ``get``/``put``/``contains`` (and ``open`` for layer-by-layer loading).
Backends move bytes; tensors <-> bytes is the serializer's job, so Redis and disk never see pickle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class ChunkKV:
    """KV of one segment, as computed once and reused anywhere.

    k: pre-RoPE keys  [num_layers, num_kv_heads, seq_len, head_dim]
    v: values         [num_layers, num_kv_heads, seq_len, head_dim]
    Keys are stored *before* rotary embedding so they can be re-positioned exactly.
    """

    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self):
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(f"ChunkKV wants k, v of one shape [layers, kv_heads, L, d]; got {tuple(self.k.shape)}, {tuple(self.v.shape)}")

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def seq_len(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class KVStore(ABC):
    """Contract: ``get`` returns either the exact KV that was ``put`` under ``key`` or None (miss).
    A corrupt, truncated or unreachable entry is a miss, never an exception and never wrong KV.
    ``put`` may be asynchronous for remote tiers; the caller must not mutate ``kv`` afterwards."""

    @abstractmethod
    def get(self, key: str) -> ChunkKV | None: ...

    @abstractmethod
    def put(self, key: str, kv: ChunkKV) -> None: ...

    def contains(self, key: str) -> bool:
        return self.get(key) is not None

    def stats(self) -> dict:
        return {}
