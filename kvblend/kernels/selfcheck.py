"""Self-check of a freshly built kernel, run in a subprocess before the build is put in place.

A miscompiled native kernel does not raise, it kills the process (gcc 12 once dropped the AMX tile
config's stores at -O3 and every prefill died with SIGSEGV) or returns wrong numbers. So the loader
runs ``python -m kvblend.kernels.selfcheck <lib.so> <kernel name> [head_dim]`` once per build: exit
0 means the library attended scattered rows (GQA, RoPE, a partial last tile, 2 threads) and (the
bf16 builds) a decoding row like an fp32 PyTorch reference, and (the AMX build) projected rows like
fp32 math rounded to bf16.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kvblend.kernels import EXIT_MISMATCH, KERNELS_BY_NAME, open_library

# Output tolerance per kernel dtype for unit-scale inputs (bf16 probabilities before P V: ~1e-2).
OUTPUT_ATOL = {torch.bfloat16: 5e-2, torch.float32: 1e-3}
# key_mass against a reference fed the same bf16-rounded rotated queries: only exp2's
# polynomial (relative error < 7.5e-5) and the order of fp32 sums differ, so |mass - ref| <=
# KEY_MASS_RTOL * max(ref, 1).
KEY_MASS_RTOL = 1e-3


def rope_half_tables(num_positions: int, head_dim: int = 64, base: float = 10000.0):
    """fp32 (cos, sin) [num_positions, head_dim / 2]: the repeated-half tables the
    kernels rotate with."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(num_positions).float()[:, None] * inv_freq[None]
    return angles.cos().contiguous(), angles.sin().contiguous()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotate_half RoPE in fp32: x [..., N, d], cos/sin [N, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def check(
    kernel, num_keys: int = 300, num_rows: int = 37, num_kv_heads: int = 2, rep: int = 3
) -> float:
    """Max abs difference of ``kernel`` (a RowsAttention, at its head_dim) from the reference;
    raises if above tolerance."""
    gen = torch.Generator().manual_seed(0)
    d = kernel.head_dim
    k = torch.randn(num_kv_heads, num_keys, d, generator=gen).to(kernel.dtype)  # [Hkv, T, d]
    v = torch.randn(num_kv_heads, num_keys, d, generator=gen).to(kernel.dtype)
    q = torch.randn(num_rows, num_kv_heads * rep, d, generator=gen).to(kernel.dtype)  # [A, Hq, d]
    positions = torch.randperm(num_keys, generator=gen)[:num_rows].sort().values
    cos, sin = rope_half_tables(num_keys, d)
    out = torch.empty(num_rows, num_kv_heads * rep * d, dtype=kernel.dtype)
    scratch = torch.empty(kernel.scratch_bytes(num_keys, num_kv_heads), dtype=torch.uint8)
    kernel(q, k, v, torch.empty_like(k), (cos, sin), positions, 1 / math.sqrt(d), out, scratch, 2)

    k_rot = rotate(k, cos, sin).to(kernel.dtype).float()
    q_rot = rotate(q.transpose(0, 1), cos[positions], sin[positions])  # [Hq, A, d]
    mask = torch.arange(num_keys)[None, :] <= positions[:, None]
    ref = (
        F.scaled_dot_product_attention(
            q_rot[None], k_rot[None], v.float()[None], attn_mask=mask, enable_gqa=True
        )[0]
        .transpose(0, 1)
        .reshape(num_rows, -1)
    )
    diff = (out.float() - ref).abs().max().item()
    if not diff <= OUTPUT_ATOL[kernel.dtype]:  # also catches NaN
        raise AssertionError(
            f"output differs from the fp32 reference by {diff} (tolerance "
            f"{OUTPUT_ATOL[kernel.dtype]})"
        )
    if kernel.has_key_mass:
        check_key_mass(
            kernel,
            q,
            k,
            v,
            positions,
            (cos, sin),
            reference_key_mass(q_rot, k_rot, mask, 1 / math.sqrt(d)),
        )
    return diff


def reference_key_mass(
    q_rot: torch.Tensor, k_rot: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """fp32 [T]: softmax probabilities summed over rows and query heads. q_rot [Hq, A, d]
    (rounded to bf16 as the kernel rounds its rotated queries), k_rot [Hkv, T, d], mask [A, T]
    bool (True = may attend)."""
    rep = q_rot.shape[0] // k_rot.shape[0]
    scores = (
        q_rot.to(torch.bfloat16).float() @ k_rot.repeat_interleave(rep, 0).transpose(1, 2) * scale
    )
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).sum(dim=(0, 1))


def check_key_mass(kernel, q, k, v, positions, rope_half, ref: torch.Tensor) -> float:
    """Max abs difference of the kernel's key_mass (added twice, from zero, then halved) from
    ``ref``; raises if above tolerance."""
    num_keys, d = k.shape[1], k.shape[2]
    out = torch.empty(q.shape[0], q.shape[1] * d, dtype=kernel.dtype)
    scratch = torch.empty(kernel.scratch_bytes(num_keys, k.shape[0]), dtype=torch.uint8)
    mass = torch.zeros(num_keys, dtype=torch.float32)
    for _ in range(2):  # it adds: two calls give twice the mass
        kernel(
            q, k, v, None, rope_half, positions, 1 / math.sqrt(d), out, scratch, 2, key_mass=mass
        )
    diff = (mass / 2 - ref).abs().max().item()
    if not diff <= KEY_MASS_RTOL * max(1.0, ref.abs().max().item()):  # also catches NaN
        raise AssertionError(
            f"key_mass differs from the fp32 reference by {diff} (tolerance {KEY_MASS_RTOL} "
            f"relative)"
        )
    return diff


def check_linear(kernel, num_rows: int = 45, num_out: int = 96, num_in: int = 64) -> float:
    """Max abs difference of ``kernel.linear`` (builds that have it) from fp32 math rounded to bf16:
    a 16-row tail past whole 32-row blocks, a partial last block, a bias, 2 threads. Raises if above
    one bf16 ulp of the output's scale."""
    if not kernel.has_linear:
        return 0.0
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(num_out, num_in, generator=gen).to(kernel.dtype)
    bias = torch.randn(num_out, generator=gen).to(kernel.dtype)
    x = torch.randn(num_rows, num_in, generator=gen).to(kernel.dtype)
    out = kernel.linear(x, kernel.pack_linear(w, bias), 2)
    ref = x.float() @ w.float().t() + bias.float()
    diff = (out.float() - ref).abs().max().item()
    tolerance = ref.abs().max().item() / 128  # one bf16 rounding
    if not diff <= tolerance:
        raise AssertionError(
            f"linear output differs from the fp32 reference by {diff} (tolerance {tolerance})"
        )
    return diff


def check_gemv(kernel, num_out: int = 70, num_in: int = 88) -> float:
    """Max abs difference of ``kernel.gemv`` (builds that have it) from fp32 math rounded to bf16,
    for 1 and for the most rows it takes: a partial last block of 4 weight rows, an input width
    past whole 32-element steps, weight rows strided (a slice of a fused weight), a bias, a
    residual, 2 threads. Raises if above one bf16 ulp of the output's scale (two with the
    residual's rounding)."""
    if not kernel.has_gemv:
        return 0.0
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(num_out + 6, num_in + 8, generator=gen).to(kernel.dtype)
    w = fused[3 : 3 + num_out, :num_in]  # [N, K], row stride K + 8
    bias = torch.randn(num_out, generator=gen).to(kernel.dtype)
    worst = 0.0
    for num_rows in (1, kernel.gemv_max_rows):
        x = torch.randn(num_rows, num_in, generator=gen).to(kernel.dtype)
        residual = torch.randn(num_rows, num_out, generator=gen).to(kernel.dtype)
        ref = x.float() @ w.float().t() + bias.float()
        for res in (None, residual):
            out = kernel.gemv(x, w, bias, 2, res)
            want = ref if res is None else ref + res.float()
            diff = (out.float() - want).abs().max().item()
            tolerance = want.abs().max().item() / (128 if res is None else 64)
            if not diff <= tolerance:  # also catches NaN
                raise AssertionError(
                    f"gemv output ({num_rows} rows) differs from the fp32 reference by {diff} "
                    f"(tolerance {tolerance})"
                )
            worst = max(worst, diff)
    return worst


def check_decode(kernel, num_keys: int = 600, num_kv_heads: int = 2, rep: int = 3) -> float:
    """Max abs difference of ``kernel.decode_attention`` (builds that have it) from fp32 attention
    of one row over every key: three key chunks, the last partial, heads strided as in a cache.
    Raises if above the output tolerance."""
    if not kernel.has_decode:
        return 0.0
    gen = torch.Generator().manual_seed(2)
    d = kernel.head_dim
    cache_k = torch.randn(num_kv_heads, num_keys + 9, d, generator=gen).to(
        kernel.dtype
    )  # [Hkv, capacity, d]
    cache_v = torch.randn(num_kv_heads, num_keys + 9, d, generator=gen).to(kernel.dtype)
    q = torch.randn(num_kv_heads * rep, 2, d, generator=gen).to(kernel.dtype)[
        :, 1
    ]  # [Hq, d], heads strided
    k, v = cache_k[:, :num_keys], cache_v[:, :num_keys]
    out = kernel.decode_attention(q, k, v, 1 / math.sqrt(d), 2)
    ref = F.scaled_dot_product_attention(
        q.float()[None, :, None], k.float()[None], v.float()[None], enable_gqa=True
    )[0].reshape(1, -1)
    diff = (out.float() - ref).abs().max().item()
    if not diff <= OUTPUT_ATOL[kernel.dtype]:  # also catches NaN
        raise AssertionError(
            f"decode output differs from the fp32 reference by {diff} (tolerance "
            f"{OUTPUT_ATOL[kernel.dtype]})"
        )
    return diff


def main(argv: list[str]) -> int:
    lib_path, name = Path(argv[0]), argv[1]
    head_dim = int(argv[2]) if len(argv) > 2 else 64
    kernel = open_library(lib_path, KERNELS_BY_NAME[name], head_dim)
    try:
        check(kernel)
        check(
            kernel, num_keys=200, num_rows=40, num_kv_heads=1, rep=8
        )  # the widest GQA the kernels take
        check_linear(kernel)
        check_gemv(kernel)
        check_decode(kernel)
    except AssertionError as e:
        print(e, file=sys.stderr)
        return EXIT_MISMATCH
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
