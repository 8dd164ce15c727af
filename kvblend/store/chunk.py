"""``ChunkKV``: one segment's KV, the value every tier stores (its own module so the serializer and
the readers need not import the store interface that uses them)."""

from __future__ import annotations

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
            raise ValueError(
                "ChunkKV wants k, v of one shape [layers, kv_heads, L, d]; got "
                f"{tuple(self.k.shape)}, {tuple(self.v.shape)}"
            )

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def seq_len(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
