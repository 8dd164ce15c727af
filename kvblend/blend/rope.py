"""Rotary embedding application, used both for fresh rows and for re-positioning cached keys.

Cached keys are stored pre-RoPE, so moving a chunk to new absolute positions is one rotation with the
new positions' cos/sin (from the model's own rotary module), exact for every rope_scaling variant.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., N, d] rotated by cos/sin [N, d] (broadcast over the leading head/layer dims)."""
    return x * cos + rotate_half(x) * sin


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse rotation (R(-theta)); for tests and for converting post-RoPE caches."""
    return x * cos - rotate_half(x) * sin
