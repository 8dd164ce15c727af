"""The native AMX attention kernel (kvblend/kernels/rows_attention.c) against fp32 references.

Skipped, with the reason, where the kernel cannot run (no gcc, a CPU without AMX-BF16). Tolerances: the
kernel rounds probabilities to bf16 before P V (as PyTorch's bf16 flash kernel does), so outputs of unit
scale differ from an fp32 reference by up to ~1e-2; rotated keys are fp32 math rounded once to bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine_fixtures import embedded_engine, musique_docs
from kvblend.config import EngineConfig, ModelConfig
from kvblend.engine.engine import create_engine
from kvblend.engine.request import GenerationRequest, SamplingParams
from kvblend.kernels import KernelUnavailable, load_rows_attention

OUT_ATOL = 3e-2


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    try:
        return load_rows_attention(tmp_path_factory.mktemp("kvblend-cache"))
    except KernelUnavailable as e:
        pytest.skip(f"AMX kernel unavailable here: {e}")


def _rope_half(num_positions: int, head_dim: int = 64, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(num_positions).float()[:, None] * inv_freq[None]
    return angles.cos().contiguous(), angles.sin().contiguous()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotate_half RoPE in fp32: x [..., N, d], cos/sin [N, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _reference(q, k, v, positions, rope):
    """fp32 attention of rows at ``positions`` with an exact causal mask; q [A, Hq, d], k/v [Hkv, T, d]."""
    num_keys = k.shape[1]
    cos, sin = rope
    k_rot = _rotate(k, cos[:num_keys], sin[:num_keys])
    q_rot = _rotate(q.transpose(0, 1), cos[positions], sin[positions])  # [Hq, A, d]
    mask = torch.arange(num_keys)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q_rot[None], k_rot.to(torch.bfloat16).float()[None], v.float()[None],
                                         attn_mask=mask, enable_gqa=True)[0]  # [Hq, A, d]
    return out.transpose(0, 1).reshape(len(positions), -1), k_rot


def _run(kernel, q, k, v, positions, rope, num_threads=2):
    num_kv_heads, num_keys, d = k.shape
    out = torch.empty(q.shape[0], q.shape[1] * d, dtype=torch.bfloat16)
    k_rot = torch.empty_like(k)
    scratch = torch.empty(kernel.scratch_bytes(num_keys, num_kv_heads), dtype=torch.uint8)
    kernel(q, k, v, k_rot, rope, positions, 1 / math.sqrt(d), out, scratch, num_threads)
    return out, k_rot


@pytest.mark.parametrize("num_keys,num_rows,num_kv_heads,rep", [
    (6254, 955, 3, 3),   # a blend@0.15 layer of the embedded model: scattered rows
    (700, 700, 2, 7),    # every row (full prefill), Qwen2-0.5B's grouping
    (200, 33, 1, 1),     # no GQA, rows not a multiple of a tile
    (45, 1, 3, 3),       # one row: the last token
])
def test_rows_attention_matches_fp32_reference(kernel, num_keys, num_rows, num_kv_heads, rep):
    gen = torch.Generator().manual_seed(num_keys)
    k = torch.randn(num_kv_heads, num_keys, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_kv_heads, num_keys, 64, generator=gen).to(torch.bfloat16)
    # queries with a large scale, so softmax is peaked and the running max moves between key steps
    q = (torch.randn(num_rows, num_kv_heads * rep, 64, generator=gen) * 3).to(torch.bfloat16)
    if num_rows == num_keys:
        positions = torch.arange(num_keys)
    else:
        positions = torch.randperm(num_keys, generator=gen)[:num_rows].sort().values
        positions[-1] = num_keys - 1
    rope = _rope_half(num_keys)
    out, k_rot = _run(kernel, q, k, v, positions, rope)
    ref, ref_k = _reference(q, k, v, positions, rope)
    assert (out.float() - ref).abs().max().item() <= OUT_ATOL
    torch.testing.assert_close(k_rot.float(), ref_k, atol=1 / 64, rtol=1 / 128)


def test_rows_never_see_a_later_key(kernel):
    """q = 0 gives uniform weights, and value = position: a row at p must read mean(0..p) = p / 2 exactly;
    a key after p (the bottom-right approximation, or a tile's later rows) would raise it."""
    num_keys = 1000
    positions = torch.tensor([0, 1, 5, 17, 40, 41, 42, 130, 131, 257, 500, 640, 641, 999])
    q = torch.zeros(len(positions), 3, 64, dtype=torch.bfloat16)
    k = torch.randn(1, num_keys, 64).to(torch.bfloat16)
    v = (torch.arange(num_keys).float() / num_keys)[None, :, None].expand(1, num_keys, 64).to(torch.bfloat16)
    out, _ = _run(kernel, q, k, v.contiguous(), positions, None)
    expected = (positions.float() / 2 / num_keys)[:, None].expand(-1, 3 * 64)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=1e-2)


def test_thread_counts_agree(kernel):
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(3, 500, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(3, 500, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(120, 9, 64, generator=gen).to(torch.bfloat16)
    positions = torch.randperm(500, generator=gen)[:120].sort().values
    rope = _rope_half(500)
    one, _ = _run(kernel, q, k, v, positions, rope, num_threads=1)
    three, _ = _run(kernel, q, k, v, positions, rope, num_threads=3)
    assert torch.equal(one, three)  # each tile is computed by one thread, the same way


def test_bad_arguments_are_rejected(kernel):
    k = torch.zeros(1, 10, 64, dtype=torch.bfloat16)
    q = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    out = torch.empty(2, 64, dtype=torch.bfloat16)
    scratch = torch.empty(kernel.scratch_bytes(10, 1), dtype=torch.uint8)
    with pytest.raises(ValueError, match="positions"):
        kernel(q, k, k, None, None, torch.tensor([3, 20]), 0.125, out, scratch, 1)  # a row past the keys
    with pytest.raises(ValueError, match="bfloat16"):
        kernel(q.float(), k, k, None, None, torch.tensor([3, 4]), 0.125, out, scratch, 1)


def test_engine_prefill_with_kernel_matches_pytorch_kernels(kernel):
    """The same prompt through full and blend@0.15 with the AMX kernel and with PyTorch's kernels (bf16:
    logits within 1.0 and the same first token, the repo's bf16 tolerance)."""
    amx = embedded_engine("bfloat16")
    if amx.attention_kernel != "amx":
        pytest.skip("the embedded engine did not pick the AMX kernel")
    ref = create_engine(EngineConfig(model=ModelConfig(dtype="bfloat16", num_threads=2, attention_kernel="torch")))
    assert ref.attention_kernel == "torch"
    docs, question = musique_docs(1, 4)
    for engine in (amx, ref):
        engine.config.blend.store_blended_prefix = False
    try:
        results = {}
        for name, engine in (("amx", amx), ("torch", ref)):
            segs = engine.segments(docs, question, instruction="Answer from the passages.\n\n")
            engine.precompute(segs.chunk_ids)
            for mode in ("full", "blend"):
                res = engine.run(GenerationRequest(segs, SamplingParams(max_tokens=1), mode=mode, recompute_ratio=0.15))
                results[(name, mode)] = res.first_token_logits
        for mode in ("full", "blend"):
            a, b = results[("amx", mode)], results[("torch", mode)]
            assert (a - b).abs().max().item() <= 1.0, mode
            assert a.argmax() == b.argmax(), mode
    finally:
        for engine in (amx, ref):
            engine.config.blend.store_blended_prefix = True


def test_attention_kernel_setting():
    with pytest.raises(ValueError, match="attention_kernel"):
        ModelConfig(attention_kernel="fast")
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        create_engine(EngineConfig(model=ModelConfig(dtype="float32", attention_kernel="amx")))
