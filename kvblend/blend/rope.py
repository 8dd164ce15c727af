"""Rotary embedding application, used both for fresh rows and for re-positioning cached keys.

Cached keys are stored pre-RoPE, so moving a chunk to new absolute positions is one rotation with
the new positions' cos/sin (from the model's own rotary module), exact for every rope_scaling
variant.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def halves_repeat(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """True when cos/sin [..., d] repeat their first half (HF rotary: emb = cat(freqs, freqs))."""
    half = cos.shape[-1] // 2
    return torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(
        sin[..., :half], sin[..., half:]
    )


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor | None = None,
    halved: bool | None = None,
) -> torch.Tensor:
    """x [..., N, d] rotated by cos/sin [N, d] (broadcast over the leading head/layer dims).

    ``out`` (same shape as x, may be a strided view such as a cache's rows) receives the result, so
    re-positioned keys go straight into the attention cache. When cos/sin repeat their first half
    (HF rotary: emb = cat(freqs, freqs), every rope_scaling variant included), the rotation runs on
    half-width views with no temporaries: half the memory traffic of the cat-based form. ``halved``:
    that property, known by the caller (None: checked here, which costs a comparison per call)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or cos.requires_grad or sin.requires_grad
    )
    if needs_grad or not (
        halves_repeat(cos, sin) if halved is None else halved
    ):  # out= ops have no autograd
        y = x * cos + rotate_half(x) * sin
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x1, x2, o1, o2 = x[..., :half], x[..., half:], out[..., :half], out[..., half:]
    torch.mul(x1, c, out=o1)
    o1.addcmul_(x2, s, value=-1)  # x1*cos - x2*sin
    torch.mul(x2, c, out=o2)
    o2.addcmul_(x1, s)  # x2*cos + x1*sin
    return out


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse rotation (R(-theta)); for tests and for converting post-RoPE caches."""
    return x * cos - rotate_half(x) * sin
