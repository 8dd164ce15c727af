"""The native attention kernels (kvblend/kernels: rows_attention.c, bf16 on AMX and, built without
AMX, on AVX512-BF16; rows_attention_f32.c, fp32 on AVX2) against float64 / fp32 references.

Each kernel's tests are skipped, with the reason, only where the machine cannot run it (no C
compiler, a CPU or OS without its ISA); a build that fails to compile or fails its self-check FAILS
them: silently falling back to PyTorch runs 2-4x slower. Both head sizes the builds take (64, 128)
are checked. Tolerances: the bf16 kernels round probabilities to bf16 before P V (as PyTorch's bf16
flash kernel does), so outputs of unit scale differ from the reference by up to ~1e-2 and rotated
keys are fp32 math rounded once to bf16; the fp32 kernel stays within 1e-4 (fp32 accumulation over
~6k keys, a 2e-7 exp2).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import embedded_engine, musique_docs

from kvblend.config import EngineConfig, ModelConfig
from kvblend.engine.engine import create_engine
from kvblend.engine.request import GenerationRequest, SamplingParams
from kvblend.kernels import (
    KERNEL_SPECS,
    KERNELS_BY_NAME,
    KernelUnavailable,
    dtype_name,
    load_rows_attention,
)
from kvblend.kernels.selfcheck import check_key_mass, reference_key_mass
from kvblend.kernels.selfcheck import rope_half_tables as _rope_half
from kvblend.kernels.selfcheck import rotate as _rotate
from kvblend.models.transformer import TransformerOps

# output atol, rotated-key (atol, rtol) per kernel dtype
TOLERANCES = {torch.bfloat16: (3e-2, (1 / 64, 1 / 128)), torch.float32: (1e-4, (1e-5, 1e-5))}


def load_or_skip(spec, cache_dir, head_dim: int = 64):
    """The build, skipped only where the machine lacks what it needs (cause cpu / os / compiler),
    failed where the build itself is at fault (it did not compile or failed its self-check)."""
    try:
        return load_rows_attention(cache_dir, spec.dtype, spec.name, head_dim)
    except KernelUnavailable as e:
        if e.is_defect:
            pytest.fail(f"the {spec.name} kernel (head_dim {head_dim}) is broken: {e}")
        pytest.skip(f"{spec.name} kernel cannot run here ({e.cause}): {e}")


@pytest.fixture(scope="module", params=[spec.name for spec in KERNEL_SPECS])
def kernel(request, tmp_path_factory):
    """Each build (head_dim 64) where this CPU runs it (an AMX CPU runs both bf16 builds)."""
    return load_or_skip(KERNELS_BY_NAME[request.param], tmp_path_factory.mktemp("kvblend-cache"))


@pytest.fixture(scope="module", params=[spec.name for spec in KERNEL_SPECS])
def kernel128(request, tmp_path_factory):
    """Each build at head_dim 128 (Qwen2.5-1.5B, Llama-3-8B, Mistral-7B, Qwen2.5-7B)."""
    return load_or_skip(
        KERNELS_BY_NAME[request.param], tmp_path_factory.mktemp("kvblend-cache"), 128
    )


def _reference(q, k, v, positions, rope):
    """fp32 attention of rows at ``positions`` with an exact causal mask; q
    [A, Hq, d], k/v [Hkv, T, d]."""
    num_keys = k.shape[1]
    cos, sin = rope
    k_rot = _rotate(k, cos[:num_keys], sin[:num_keys])
    q_rot = _rotate(q.transpose(0, 1), cos[positions], sin[positions])  # [Hq, A, d]
    mask = torch.arange(num_keys)[None, :] <= positions[:, None]
    k_seen = k_rot.to(k.dtype).double()  # the kernel attends its own rounding of the rotated keys
    out = F.scaled_dot_product_attention(
        q_rot.double()[None], k_seen[None], v.double()[None], attn_mask=mask, enable_gqa=True
    )[0]  # [Hq, A, d]
    return out.transpose(0, 1).reshape(len(positions), -1).float(), k_rot


def _run(kernel, q, k, v, positions, rope, num_threads=2):
    num_kv_heads, num_keys, d = k.shape
    out = torch.empty(q.shape[0], q.shape[1] * d, dtype=kernel.dtype)
    k_rot = torch.empty_like(k)
    scratch = torch.empty(kernel.scratch_bytes(num_keys, num_kv_heads), dtype=torch.uint8)
    kernel(q, k, v, k_rot, rope, positions, 1 / math.sqrt(d), out, scratch, num_threads)
    return out, k_rot


@pytest.mark.parametrize(
    "num_keys,num_rows,num_kv_heads,rep",
    [
        (6254, 955, 3, 3),  # a blend@0.15 layer of the embedded model: scattered rows
        (700, 700, 2, 7),  # every row (full prefill), Qwen2-0.5B's grouping
        (200, 33, 1, 1),  # no GQA, rows not a multiple of a tile
        (45, 1, 3, 3),  # one row: the last token
    ],
)
def test_rows_attention_matches_fp32_reference(kernel, num_keys, num_rows, num_kv_heads, rep):
    gen = torch.Generator().manual_seed(num_keys)
    k = torch.randn(num_kv_heads, num_keys, 64, generator=gen).to(kernel.dtype)
    v = torch.randn(num_kv_heads, num_keys, 64, generator=gen).to(kernel.dtype)
    # queries with a large scale, so softmax is peaked and the running max moves between key steps
    q = (torch.randn(num_rows, num_kv_heads * rep, 64, generator=gen) * 3).to(kernel.dtype)
    if num_rows == num_keys:
        positions = torch.arange(num_keys)
    else:
        positions = torch.randperm(num_keys, generator=gen)[:num_rows].sort().values
        positions[-1] = num_keys - 1
    rope = _rope_half(num_keys)
    out, k_rot = _run(kernel, q, k, v, positions, rope)
    ref, ref_k = _reference(q, k, v, positions, rope)
    out_atol, (k_atol, k_rtol) = TOLERANCES[kernel.dtype]
    assert (out.float() - ref).abs().max().item() <= out_atol
    torch.testing.assert_close(k_rot.float(), ref_k, atol=k_atol, rtol=k_rtol)


def test_rows_never_see_a_later_key(kernel):
    """q = 0 gives uniform weights, and value = position: a row at p must read mean(0..p)
    = p / 2 exactly; a key after p (the bottom-right approximation, or a tile's later
    rows) would raise it."""
    num_keys = 1000
    positions = torch.tensor([0, 1, 5, 17, 40, 41, 42, 130, 131, 257, 500, 640, 641, 999])
    q = torch.zeros(len(positions), 3, 64, dtype=kernel.dtype)
    k = torch.randn(1, num_keys, 64).to(kernel.dtype)
    v = (
        (torch.arange(num_keys).float() / num_keys)[None, :, None]
        .expand(1, num_keys, 64)
        .to(kernel.dtype)
    )
    out, _ = _run(kernel, q, k, v.contiguous(), positions, None)
    expected = (positions.float() / 2 / num_keys)[:, None].expand(-1, 3 * 64)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=1e-2)


def _scattered_rows_case(dtype: torch.dtype, seed: int, num_keys: int, num_rows: int):
    """(q [A, 9, 64], k, v [3, T, 64], sorted random positions [A], RoPE tables):
    SmolLM2's grouping."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(3, num_keys, 64, generator=gen).to(dtype)
    v = torch.randn(3, num_keys, 64, generator=gen).to(dtype)
    q = torch.randn(num_rows, 9, 64, generator=gen).to(dtype)
    positions = torch.randperm(num_keys, generator=gen)[:num_rows].sort().values
    return q, k, v, positions, _rope_half(num_keys)


def test_thread_counts_agree(kernel):
    case = _scattered_rows_case(kernel.dtype, 1, 500, 120)
    one, _ = _run(kernel, *case, num_threads=1)
    three, _ = _run(kernel, *case, num_threads=3)
    assert torch.equal(one, three)  # each tile is computed by one thread, the same way


def test_bad_arguments_are_rejected(kernel):
    k = torch.zeros(1, 10, 64, dtype=kernel.dtype)
    q = torch.zeros(2, 1, 64, dtype=kernel.dtype)
    out = torch.empty(2, 64, dtype=kernel.dtype)
    scratch = torch.empty(kernel.scratch_bytes(10, 1), dtype=torch.uint8)
    with pytest.raises(ValueError, match="positions"):
        kernel(
            q, k, k, None, None, torch.tensor([3, 20]), 0.125, out, scratch, 1
        )  # a row past the keys
    other = torch.float16
    with pytest.raises(ValueError, match=f"{dtype_name(kernel.dtype)} CPU tensor"):
        kernel(q.to(other), k, k, None, None, torch.tensor([3, 4]), 0.125, out, scratch, 1)


@pytest.mark.parametrize(
    "num_keys,num_rows,rep",
    [
        (6254, 30, 3),  # lookahead's reuse pass on the embedded model: the query rows at the end
        (700, 700, 7),  # every row, Qwen2-0.5B's grouping (tiles of several positions)
        (300, 37, 3),  # scattered rows; the last key step is partial
        (33, 1, 1),  # one row, one key past a block
    ],
)
def test_key_mass_is_the_softmax_probabilities_summed_over_rows_and_heads(
    kernel, num_keys, num_rows, rep
):
    """key_mass (the bf16 builds): each key's attention probability summed over rows and query
    heads, the ranking lookahead's reuse pass records, against fp32 softmax fed the kernel's bf16
    rotated queries (selfcheck.KEY_MASS_RTOL). Every row's probabilities sum to 1, so the mass
    sums to rows x heads."""
    if not kernel.has_key_mass:
        pytest.skip(f"the {kernel.name} kernel records no key mass")
    gen = torch.Generator().manual_seed(num_keys)
    k = torch.randn(2, num_keys, 64, generator=gen).to(kernel.dtype)
    v = torch.randn(2, num_keys, 64, generator=gen).to(kernel.dtype)
    q = (torch.randn(num_rows, 2 * rep, 64, generator=gen) * 3).to(
        kernel.dtype
    )  # peaked: the max moves
    positions = torch.randperm(num_keys, generator=gen)[:num_rows].sort().values
    if num_rows == num_keys or num_rows == 30:
        positions = torch.arange(num_keys - num_rows, num_keys)
    rope = _rope_half(num_keys)
    _, k_rot = _reference(q, k, v, positions, rope)
    q_rot = _rotate(q.transpose(0, 1), rope[0][positions], rope[1][positions])  # [Hq, A, d]
    mask = torch.arange(num_keys)[None, :] <= positions[:, None]
    ref = reference_key_mass(q_rot, k_rot.to(kernel.dtype).float(), mask, 1 / 8)
    check_key_mass(kernel, q, k, v, positions, rope, ref)  # raises past the tolerance
    mass = torch.zeros(num_keys)
    out = torch.empty(num_rows, 2 * rep * 64, dtype=kernel.dtype)
    scratch = torch.empty(kernel.scratch_bytes(num_keys, 2), dtype=torch.uint8)
    kernel(q, k, v, None, rope, positions, 1 / 8, out, scratch, 2, key_mass=mass)
    assert mass.sum().item() == pytest.approx(num_rows * 2 * rep, rel=1e-4)
    assert (
        mass[int(positions[-1]) + 1 :].abs().sum().item() == 0
    )  # no row reads a key after its position
    assert torch.equal(
        out, _run(kernel, q, k, v, positions, rope)[0]
    )  # recording leaves the output alone


def test_key_mass_is_refused_with_a_wrong_buffer_or_build(kernel):
    k = torch.zeros(1, 10, 64, dtype=kernel.dtype)
    q = torch.zeros(2, 1, 64, dtype=kernel.dtype)
    out = torch.empty(2, 64, dtype=kernel.dtype)
    scratch = torch.empty(kernel.scratch_bytes(10, 1), dtype=torch.uint8)
    positions = torch.tensor([3, 4])
    if not kernel.has_key_mass:
        with pytest.raises(ValueError, match="does not sum key mass"):
            kernel(q, k, k, None, None, positions, 0.125, out, scratch, 1, key_mass=torch.zeros(10))
        return
    for bad in (torch.zeros(9), torch.zeros(10, dtype=torch.float64), torch.zeros(20)[::2]):
        with pytest.raises(
            ValueError, match=r"key_mass must be a contiguous float32 CPU tensor \[10\]"
        ):
            kernel(q, k, k, None, None, positions, 0.125, out, scratch, 1, key_mass=bad)


@pytest.mark.parametrize("num_rows", [1, 16, 45, 96, 960])
def test_linear_matches_fp32_math_rounded_once(kernel, num_rows):
    """The AMX build's row projection: fp32 accumulation, bias in fp32, one rounding to bf16, so
    it is within one bf16 rounding of fp32 math (and equal to it rounded, up to summation-order
    ties). Row counts cover a lone row, one 16-row tile, a partial last block and whole 32-row
    blocks; strided rows."""
    if not kernel.has_linear:
        pytest.skip(f"the {kernel.name} build has no linear kernel")
    gen = torch.Generator().manual_seed(num_rows)
    w = torch.randn(576, 1536, generator=gen).div(40).to(kernel.dtype)
    bias = torch.randn(576, generator=gen).to(kernel.dtype)
    x = torch.randn(num_rows, 1600, generator=gen).to(kernel.dtype)[:, :1536]  # row stride 1600
    out = kernel.linear(x, kernel.pack_linear(w, bias), 2)
    ref = x.float() @ w.float().t() + bias.float()
    ulp = ref.abs().clamp_min(1e-3) / 128
    assert out.shape == (num_rows, 576) and bool(((out.float() - ref).abs() <= ulp).all())
    assert (out == ref.to(kernel.dtype)).float().mean().item() > 0.99
    no_bias = kernel.linear(x, kernel.pack_linear(w), 1)  # one thread, no bias
    assert bool(((no_bias.float() - (ref - bias.float())).abs() <= ulp + 1 / 128).all())
    residual = torch.randn(num_rows, 576, generator=gen).to(kernel.dtype)
    summed = kernel.linear(
        x, kernel.pack_linear(w, bias), 2, residual
    )  # rounded product, then the add
    assert torch.equal(summed, residual + out)
    into = torch.zeros(num_rows, 640, dtype=kernel.dtype)[
        :, :576
    ]  # a caller's rows (an MLP row block)
    assert kernel.linear(x, kernel.pack_linear(w, bias), 2, residual, into) is into and torch.equal(
        into, summed
    )


def test_packed_columns_project_like_the_weight_rows_they_cover(kernel):
    """A fused q/k/v weight packed once: each part's columns (a view) project as that
    part's own weight."""
    if not kernel.has_linear:
        pytest.skip(f"the {kernel.name} build has no linear kernel")
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(160, 64, generator=gen).div(8).to(kernel.dtype)
    bias = torch.randn(160, generator=gen).to(kernel.dtype)
    x = torch.randn(37, 64, generator=gen).to(kernel.dtype)
    packed = kernel.pack_linear(w, bias)
    assert packed.columns(0, 160) is packed
    for start, end in ((0, 96), (96, 128), (128, 160), (32, 160)):
        part = packed.columns(start, end)
        assert part.num_out == end - start and part.packed.data_ptr() > 0
        assert torch.equal(
            kernel.linear(x, part, 2),
            kernel.linear(x, kernel.pack_linear(w[start:end], bias[start:end]), 2),
        )
    for start, end in ((0, 40), (16, 64), (96, 96), (0, 192)):
        with pytest.raises(ValueError, match="multiples of 32"):
            packed.columns(start, end)


def test_linear_refuses_shapes_it_does_not_take(kernel):
    if not kernel.has_linear:
        pytest.skip(f"the {kernel.name} build has no linear kernel")
    assert (
        kernel.pack_linear(torch.zeros(40, 64, dtype=kernel.dtype)) is None
    )  # outputs not a multiple of 32
    packed = kernel.pack_linear(torch.zeros(64, 64, dtype=kernel.dtype))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        kernel.linear(torch.zeros(3, 32, dtype=kernel.dtype), packed, 1)


@pytest.mark.parametrize("num_rows", [1, 3, 16])
@pytest.mark.parametrize("num_out,num_in", [(576, 1536), (1537, 896), (5, 40)])
def test_gemv_matches_fp32_math_rounded_once(kernel, num_rows, num_out, num_in):
    """The bf16 builds' few-row projection (decoding), on the module's own weight: within one bf16
    rounding of fp32 math, with a bias in fp32 and the residual added after the rounding, as
    F.linear then torch.add round. Shapes cover SmolLM2's and Qwen's widths, an output count past
    whole blocks of 4 weight rows, an input width past whole 32-element steps, and strided rows
    (a slice of a fused weight, an MLP row block)."""
    if not kernel.has_gemv:
        pytest.skip(f"the {kernel.name} build has no gemv kernel")
    gen = torch.Generator().manual_seed(num_rows * 7 + num_out)
    fused = torch.randn(num_out + 8, num_in + 16, generator=gen).div(40).to(kernel.dtype)
    w = fused[4 : 4 + num_out, :num_in]  # [N, K], row stride K + 16
    bias = torch.randn(num_out, generator=gen).to(kernel.dtype)
    x = torch.randn(num_rows, num_in + 32, generator=gen).to(kernel.dtype)[:, :num_in]
    ref = x.float() @ w.float().t() + bias.float()
    ulp = ref.abs().clamp_min(1e-3) / 128
    for num_threads in (1, 2):
        out = kernel.gemv(x, w, bias, num_threads)
        assert out.shape == (num_rows, num_out)
        assert bool(((out.float() - ref).abs() <= ulp).all())
        assert (out == ref.to(kernel.dtype)).float().mean().item() > 0.98
    no_bias = kernel.gemv(x, w, None, 2)
    assert bool(((no_bias.float() - (ref - bias.float())).abs() <= ulp + 1 / 128).all())
    residual = torch.randn(num_rows, num_out, generator=gen).to(kernel.dtype)
    into = torch.zeros(num_rows, num_out + 8, dtype=kernel.dtype)[:, :num_out]
    summed = kernel.gemv(x, w, bias, 2, residual, into)
    assert summed is into and torch.equal(summed, residual + kernel.gemv(x, w, bias, 2))


def test_gemv_refuses_what_it_does_not_take(kernel):
    if not kernel.has_gemv:
        pytest.skip(f"the {kernel.name} build has no gemv kernel")
    w = torch.zeros(8, 64, dtype=kernel.dtype)
    too_many = torch.zeros(kernel.gemv_max_rows + 1, 64, dtype=kernel.dtype)
    with pytest.raises(ValueError, match="rows"):
        kernel.gemv(too_many, w, None, 1)
    with pytest.raises(ValueError, match=r"x must be .*\[rows, 64\]"):
        kernel.gemv(torch.zeros(1, 32, dtype=kernel.dtype), w, None, 1)
    with pytest.raises(ValueError, match="CPU tensor"):
        kernel.gemv(torch.zeros(1, 64), w, None, 1)


def _check_decode(kernel, head_dim: int, num_keys: int, num_kv_heads: int, rep: int) -> None:
    """One decoding row over a cache's rotated keys, read in place (heads strided by the cache's
    capacity), on 1 and 2 threads: within the bf16 output tolerance of fp64 attention."""
    if not kernel.has_decode:
        pytest.skip(f"the {kernel.name} build has no decode kernel")
    gen = torch.Generator().manual_seed(num_keys * 10 + rep)
    cache_k = torch.randn(num_kv_heads, num_keys + 40, head_dim, generator=gen).to(kernel.dtype)
    cache_v = torch.randn(num_kv_heads, num_keys + 40, head_dim, generator=gen).to(kernel.dtype)
    q = (
        torch.randn(num_kv_heads * rep, 3, head_dim, generator=gen).mul(2).to(kernel.dtype)[:, 2]
    )  # [Hq, d], strided
    k, v = cache_k[:, :num_keys], cache_v[:, :num_keys]
    ref = (
        F.scaled_dot_product_attention(
            q.double()[None, :, None], k.double()[None], v.double()[None], enable_gqa=True
        )[0]
        .reshape(1, -1)
        .float()
    )
    for num_threads in (1, 2):
        out = kernel.decode_attention(q, k, v, head_dim**-0.5, num_threads)
        assert out.shape == (1, num_kv_heads * rep * head_dim)
        assert (out.float() - ref).abs().max().item() <= TOLERANCES[kernel.dtype][0]


@pytest.mark.parametrize("num_keys", [1, 100, 256, 257, 3000])
@pytest.mark.parametrize("num_kv_heads,rep", [(3, 3), (2, 7), (1, 1)])
def test_decode_attention_matches_fp32_reference(kernel, num_keys, num_kv_heads, rep):
    """One decoding row over a cache's rotated keys, read in place (heads strided by the
    cache's capacity): within the bf16 output tolerance of fp32 attention. Key counts cover one
    key, a chunk's edge (256 keys a chunk) and many chunks; GQA factors SmolLM2's 3,
    Qwen2.5-0.5B's 7 and none."""
    _check_decode(kernel, 64, num_keys, num_kv_heads, rep)


def test_decode_attention_refuses_what_it_does_not_take(kernel):
    if not kernel.has_decode:
        pytest.skip(f"the {kernel.name} build has no decode kernel")
    k = torch.zeros(2, 10, 64, dtype=kernel.dtype)
    with pytest.raises(
        ValueError, match="rejected"
    ):  # 17 query heads a KV head: more than it keeps
        kernel.decode_attention(torch.zeros(34, 64, dtype=kernel.dtype), k, k, 0.125, 1)
    with pytest.raises(ValueError, match=r"k, v \[Hkv, n, d\] alike"):
        kernel.decode_attention(torch.zeros(4, 64, dtype=kernel.dtype), k, k[:, :9], 0.125, 1)
    with pytest.raises(ValueError, match="CPU tensor"):
        kernel.decode_attention(torch.zeros(4, 64), k, k, 0.125, 1)


def test_engine_decoding_with_kernel_matches_sdpa(kernel, monkeypatch):
    """Greedy decoding over a ~2.5k-token prompt's cache (10 key chunks) with the native decode
    kernel gives the tokens PyTorch's SDPA gives (the prefill is the same in both runs)."""
    if not kernel.has_decode:
        pytest.skip(f"the {kernel.name} build has no decode kernel")
    engine = embedded_engine(dtype_name(kernel.dtype), attention_kernel=kernel.name)
    docs, question = musique_docs(0, 4)
    segs = engine.segments(docs, question, instruction="Answer from the passages.\n\n")

    def request() -> GenerationRequest:
        return GenerationRequest(segs, SamplingParams(max_tokens=12, ignore_eos=True), mode="full")

    native = engine.run(request())
    sdpa = TransformerOps.decode_attend
    monkeypatch.setattr(
        TransformerOps,
        "decode_attend",
        lambda self, q, k, v: self.attend(q[:, None], k, v, mask=None, causal=False),
    )
    reference = engine.run(request())
    monkeypatch.setattr(TransformerOps, "decode_attend", sdpa)
    assert native.token_ids == reference.token_ids and len(native.token_ids) == 12


def _hf_rms_norm(dim: int, gen: torch.Generator, dtype: torch.dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(dim, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(dim, generator=gen).to(dtype)
    return norm


@pytest.mark.parametrize("num_rows", [1, 17, 300])
def test_rms_norm_rounds_as_the_hf_module(kernel, num_rows):
    """The bf16 builds' RMSNorm against transformers' LlamaRMSNorm on the same bf16 rows: within
    one bf16 ulp everywhere (sums of squares add in another order) and equal almost everywhere;
    with a residual delta, the stored sum equals PyTorch's bf16 add exactly and the norm is the
    module's on that sum."""
    if not kernel.has_elementwise:
        pytest.skip(f"the {kernel.name} build has no row-wise ops")
    gen = torch.Generator().manual_seed(num_rows)
    norm = _hf_rms_norm(576, gen, kernel.dtype)
    x = torch.randn(num_rows, 600, generator=gen).mul(3).to(kernel.dtype)[:, :576]  # strided rows
    delta = torch.randn(num_rows, 576, generator=gen).to(kernel.dtype)
    for d in (None, delta):
        out, total = kernel.rms_norm(x, norm.weight, norm.variance_epsilon, 2, d)
        expected_total = x if d is None else x + d
        if d is not None:
            assert torch.equal(total, expected_total)
        ref = norm(expected_total)
        ulp = ref.float().abs() / 128 + 1e-6
        assert bool(((out.float() - ref.float()).abs() <= ulp).all())
        assert (out == ref).float().mean().item() > 0.99


def test_silu_mul_rounds_as_pytorch(kernel):
    """SiLU(gate) * up on bf16 rows against F.silu(gate) * up: SiLU rounded to bf16 first, as
    PyTorch's bf16 silu returns it, so equal up to exp's last fp32 bits (one bf16 ulp where a
    tie falls apart)."""
    if not kernel.has_elementwise:
        pytest.skip(f"the {kernel.name} build has no row-wise ops")
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(45, 3072, generator=gen).mul(4).to(kernel.dtype)
    gate_up[0, :6] = torch.tensor([-200.0, -90.0, 0.0, 90.0, 200.0, -0.0])  # exp's range ends
    gate, up = gate_up.chunk(2, dim=-1)
    out = kernel.silu_mul(gate_up, 2)
    ref = F.silu(gate) * up
    assert out.shape == (45, 1536) and bool(torch.isfinite(out.float()).all())
    assert bool(((out.float() - ref.float()).abs() <= ref.float().abs() / 128 + 1e-6).all())
    assert (out == ref).float().mean().item() > 0.99
    with pytest.raises(ValueError, match="dense rows"):
        kernel.silu_mul(gate_up.to(torch.float16), 1)


def test_concurrent_calls_from_two_threads(kernel):
    """The kernels keep a thread pool between calls; a call that finds it busy (another Python
    thread) starts its own threads. Both must give what a lone call gives."""
    import concurrent.futures

    case = _scattered_rows_case(kernel.dtype, 2, 700, 200)
    alone, _ = _run(kernel, *case, num_threads=2)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: _run(kernel, *case, num_threads=2)[0], range(16)))
    assert all(torch.equal(r, alone) for r in results)


def test_engine_prefill_with_kernel_matches_pytorch_kernels(kernel):
    """The same prompt through full and blend@0.15 with the native kernel and with
    PyTorch's kernels: the same first token, logits within 1.0 in bf16 (the repo's bf16
    tolerance) and 1e-3 in fp32."""
    dtype = dtype_name(kernel.dtype)
    native = embedded_engine(dtype, attention_kernel=kernel.name)
    assert native.attention_kernel == kernel.name
    ref = create_engine(
        EngineConfig(model=ModelConfig(dtype=dtype, num_threads=2, attention_kernel="torch"))
    )
    assert ref.attention_kernel == "torch"
    docs, question = musique_docs(1, 4)
    for engine in (native, ref):
        engine.config.blend.store_blended_prefix = False
    try:
        results = {}
        for name, engine in (("native", native), ("torch", ref)):
            segs = engine.segments(docs, question, instruction="Answer from the passages.\n\n")
            engine.precompute(segs.chunk_ids)
            for mode in ("full", "blend"):
                res = engine.run(
                    GenerationRequest(
                        segs, SamplingParams(max_tokens=1), mode=mode, recompute_ratio=0.15
                    )
                )
                results[(name, mode)] = res.first_token_logits
        for mode in ("full", "blend"):
            a, b = results[("native", mode)], results[("torch", mode)]
            assert (a - b).abs().max().item() <= (1.0 if dtype == "bfloat16" else 1e-3), mode
            assert a.argmax() == b.argmax(), mode
    finally:
        for engine in (native, ref):
            engine.config.blend.store_blended_prefix = True


def test_attention_kernel_setting():
    with pytest.raises(ValueError, match="attention_kernel"):
        ModelConfig(attention_kernel="fast")
    with pytest.raises(ValueError, match="bfloat16 only"):
        create_engine(EngineConfig(model=ModelConfig(dtype="float32", attention_kernel="amx")))
    with pytest.raises(ValueError, match="float32 only"):
        create_engine(EngineConfig(model=ModelConfig(dtype="bfloat16", attention_kernel="avx2")))
    with pytest.raises(ValueError, match="bfloat16 only"):
        create_engine(
            EngineConfig(model=ModelConfig(dtype="float32", attention_kernel="avx512bf16"))
        )


def test_bf16_falls_back_to_avx512bf16_when_the_amx_build_fails(tmp_path, monkeypatch):
    """A failed AMX build (gcc 12 once miscompiled it) leaves the AVX512-BF16 build of the same
    source, not PyTorch; the AMX build's reason is still the one reported when neither can run."""
    from kvblend import kernels

    if not set(KERNELS_BY_NAME["avx512bf16"].cpu_flags) <= kernels.cpu_flags():
        pytest.skip("this CPU lacks AVX512-BF16")
    real = kernels._build_and_load

    def amx_fails(spec, out_dir, head_dim=64):
        if spec.name == "amx":
            raise KernelUnavailable("the amx kernel failed its self-check: simulated", "selfcheck")
        return real(spec, out_dir, head_dim)

    monkeypatch.setattr(kernels, "_build_and_load", amx_fails)
    assert load_rows_attention(tmp_path / "a", torch.bfloat16).name == "avx512bf16"
    with pytest.raises(KernelUnavailable, match="simulated"):
        load_rows_attention(tmp_path / "b", torch.bfloat16, "amx")

    def every_build_fails(spec, out_dir, head_dim=64):
        raise KernelUnavailable(f"{spec.name} unavailable")

    monkeypatch.setattr(kernels, "_build_and_load", every_build_fails)
    with pytest.raises(KernelUnavailable, match="^amx unavailable"):
        load_rows_attention(tmp_path / "c", torch.bfloat16)


BROKEN_KERNELS = {
    # a kernel that dies: the self-check must catch it in its subprocess, not in the caller
    "crash": "*(volatile int *)0 = 1;",
    # a kernel that returns wrong numbers (zeros)
    "zeros": "for (long r = 0; r < num_rows; r++) memset(out + r * out_row_stride, 0, "
    "(size_t)num_kv_heads * rep * head_dim * 4);",
    # a library without the entry point: refused, but it says nothing about the
    # numbers, so not recorded
    "no-symbol": None,
}


def _broken_source(path, broken: str):
    body = BROKEN_KERNELS[broken]
    name = "kvb_rows_attention" if body is not None else "kvb_other"
    path.write_text(
        "#include <string.h>\n"
        "long kvb_rows_attention_scratch_bytes(long num_keys, int num_kv_heads) { return 64; }\n"
        f"int {name}(const void *q, long qs, const void *k, long ks, const void *v, long vs,\n"
        "    void *k_rot, long krs, const float *c, const float *s, const long *pos,"
        " long num_rows, long num_keys,\n"
        "    int num_kv_heads, int rep, int head_dim, float scale, float *out,"
        " long out_row_stride,\n"
        "    void *scratch, long scratch_bytes, int num_threads) {\n"
        f"    {body or ''}\n    return 0;\n}}\n"
    )
    return path


@pytest.mark.parametrize("broken", sorted(BROKEN_KERNELS))
def test_a_build_failing_its_self_check_is_never_loaded(broken, tmp_path):
    """A miscompiled kernel (gcc 12 once dropped the AMX tile config's stores: every prefill died
    with SIGSEGV) is caught by the build's self-check: no library is put in place, and loading
    says why instead of crashing. A crash or wrong numbers are recorded (not retried); other
    failures are not."""
    import shutil

    from kvblend import kernels

    cc = shutil.which("gcc") or shutil.which("cc")
    spec = KERNELS_BY_NAME["avx2"]
    if cc is None or not set(spec.cpu_flags) <= kernels.cpu_flags():
        pytest.skip("needs gcc and an AVX2 CPU")
    source = _broken_source(tmp_path / "broken.c", broken)
    path = tmp_path / "kernels" / "broken.so"
    failed = path.with_suffix(".failed")
    with pytest.raises(KernelUnavailable, match="failed its self-check") as info:
        kernels._build_checked(spec, cc, source, path, failed)
    message = str(info.value)
    assert ("SIGSEGV" in message) == (broken == "crash")
    assert ("differs from the fp32 reference" in message) == (broken == "zeros")
    assert ("kvb_rows_attention" in message) == (
        broken == "no-symbol"
    )  # the AttributeError's last line
    assert not path.exists() and not list(path.parent.glob("*.tmp"))
    if broken == "no-symbol":
        assert not failed.exists()
    else:
        assert failed.read_text().strip() == message


def test_openmp_spin_default_leaves_the_users_choice(monkeypatch):
    """The CLI sets GOMP_SPINCOUNT before torch loads OpenMP, unless a spin count or
    wait policy is set."""
    import os

    from kvblend.platform import OPENMP_SPIN_COUNT, apply_openmp_defaults

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert apply_openmp_defaults() and os.environ["GOMP_SPINCOUNT"] == OPENMP_SPIN_COUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    assert not apply_openmp_defaults() and os.environ["GOMP_SPINCOUNT"] == "5"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert not apply_openmp_defaults() and "GOMP_SPINCOUNT" not in os.environ


def test_malloc_default_leaves_the_users_choice(monkeypatch):
    """The CLI sets glibc's mmap and trim thresholds (a prefill's freed blocks stay in the heap
    instead of being faulted in again every layer), unless the user set glibc's own variables."""
    import platform

    from kvblend.platform import apply_malloc_defaults

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert not apply_malloc_defaults()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert not apply_malloc_defaults()
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert apply_malloc_defaults()


# --- head_dim 128 (Qwen2.5-1.5B, Llama-3-8B, Mistral-7B, Qwen2.5-7B) and GQA ratios 1:1 to 8:1 ----


def _case(dtype, seed: int, num_keys: int, num_rows: int, num_kv_heads: int, rep: int, d: int):
    """(q [A, Hkv * rep, d] peaked, k, v [Hkv, T, d], sorted positions [A] ending at
    the last key, RoPE)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_kv_heads, num_keys, d, generator=gen).to(dtype)
    v = torch.randn(num_kv_heads, num_keys, d, generator=gen).to(dtype)
    q = (torch.randn(num_rows, num_kv_heads * rep, d, generator=gen) * 3).to(
        dtype
    )  # the running max moves
    if num_rows == num_keys:
        positions = torch.arange(num_keys)
    else:
        positions = torch.randperm(num_keys - 1, generator=gen)[: num_rows - 1].sort().values
        positions = torch.cat([positions, torch.tensor([num_keys - 1])])
    return q, k, v, positions, _rope_half(num_keys, d)


@pytest.mark.parametrize(
    "num_keys,num_rows,num_kv_heads,rep",
    [
        (1500, 225, 2, 6),  # Qwen2.5-1.5B's grouping (12 / 2 heads), 15% scattered rows
        (400, 400, 1, 8),  # every row (full prefill), GQA 8:1 (Llama-3-70B's, the widest)
        (300, 37, 4, 1),  # no GQA (Llama-2-7B), rows not a multiple of a tile
        (257, 40, 2, 4),  # GQA 4:1 (Llama-3-8B / Mistral-7B); a key past a block
        (150, 150, 4, 2),  # GQA 2:1, every row
        (45, 1, 2, 6),  # one row: the last token
    ],
)
def test_head_dim_128_rows_attention_matches_fp64_reference(
    kernel128, num_keys, num_rows, num_kv_heads, rep
):
    """Rows with the exact causal mask by position at head_dim 128, against fp64 attention over the
    kernel's own bf16 (or fp32) rotated keys; the rotated keys against fp32 RoPE rounded once."""
    kernel = kernel128
    q, k, v, positions, rope = _case(
        kernel.dtype, num_keys + rep, num_keys, num_rows, num_kv_heads, rep, 128
    )
    out, k_rot = _run(kernel, q, k, v, positions, rope)
    ref, ref_k = _reference(q, k, v, positions, rope)
    out_atol, (k_atol, k_rtol) = TOLERANCES[kernel.dtype]
    assert out.shape == (num_rows, num_kv_heads * rep * 128)
    assert (out.float() - ref).abs().max().item() <= out_atol
    torch.testing.assert_close(k_rot.float(), ref_k, atol=k_atol, rtol=k_rtol)


@pytest.mark.parametrize("rep", [1, 2, 4, 8])
def test_head_dim_64_gqa_ratios_match_fp64_reference(kernel, rep):
    """GQA 1:1 to 8:1 at head_dim 64, scattered rows (the 3:1 and 7:1 models are covered above)."""
    q, k, v, positions, rope = _case(kernel.dtype, rep, 500, 70, 2, rep, 64)
    out, _ = _run(kernel, q, k, v, positions, rope)
    ref, _ = _reference(q, k, v, positions, rope)
    assert (out.float() - ref).abs().max().item() <= TOLERANCES[kernel.dtype][0]


def test_head_dim_128_rows_never_see_a_later_key(kernel128):
    """As at 64: q = 0 and value = position, so a row at p reads mean(0..p) = p / 2 exactly."""
    kernel, num_keys = kernel128, 700
    positions = torch.tensor([0, 1, 5, 17, 40, 41, 42, 130, 131, 257, 500, 640, 641, 699])
    q = torch.zeros(len(positions), 4, 128, dtype=kernel.dtype)
    k = torch.randn(1, num_keys, 128).to(kernel.dtype)
    v = (
        (torch.arange(num_keys).float() / num_keys)[None, :, None]
        .expand(1, num_keys, 128)
        .to(kernel.dtype)
    )
    out, _ = _run(kernel, q, k, v.contiguous(), positions, None)
    expected = (positions.float() / 2 / num_keys)[:, None].expand(-1, 4 * 128)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("num_keys,num_rows,rep", [(1200, 30, 6), (300, 300, 8), (200, 37, 1)])
def test_head_dim_128_key_mass(kernel128, num_keys, num_rows, rep):
    """Lookahead's key mass at head_dim 128 against fp32 softmax fed the kernel's bf16 rotated
    queries; the mass of all keys sums to rows x heads."""
    kernel = kernel128
    if not kernel.has_key_mass:
        pytest.skip(f"the {kernel.name} kernel records no key mass")
    q, k, v, positions, rope = _case(kernel.dtype, num_keys, num_keys, num_rows, 2, rep, 128)
    if num_rows == 30:  # lookahead's reuse pass: the query rows at the end
        positions = torch.arange(num_keys - num_rows, num_keys)
    _, k_rot = _reference(q, k, v, positions, rope)
    q_rot = _rotate(q.transpose(0, 1), rope[0][positions], rope[1][positions])  # [Hq, A, d]
    mask = torch.arange(num_keys)[None, :] <= positions[:, None]
    ref = reference_key_mass(q_rot, k_rot.to(kernel.dtype).float(), mask, 128**-0.5)
    check_key_mass(kernel, q, k, v, positions, rope, ref)  # raises past the tolerance
    assert ref.sum().item() == pytest.approx(num_rows * 2 * rep, rel=1e-4)


@pytest.mark.parametrize("num_keys", [1, 257, 3000])
@pytest.mark.parametrize("num_kv_heads,rep", [(2, 6), (1, 8), (4, 1), (2, 4)])
def test_head_dim_128_decode_attention_matches_fp64_reference(
    kernel128, num_keys, num_kv_heads, rep
):
    """One decoding row at head_dim 128 over a cache read in place (heads strided
    by its capacity)."""
    _check_decode(kernel128, 128, num_keys, num_kv_heads, rep)


def test_a_build_refuses_another_head_dim(kernel128):
    k = torch.zeros(1, 10, 64, dtype=kernel128.dtype)
    out = torch.empty(2, 64, dtype=kernel128.dtype)
    scratch = torch.empty(kernel128.scratch_bytes(10, 1), dtype=torch.uint8)
    with pytest.raises(ValueError, match="attends head_dim 128, got 64"):
        kernel128(
            torch.zeros(2, 1, 64, dtype=kernel128.dtype),
            k,
            k,
            None,
            None,
            torch.tensor([3, 4]),
            0.125,
            out,
            scratch,
            1,
        )
    with pytest.raises(KernelUnavailable, match="head_dim 64 or 128 only") as info:
        load_rows_attention(kernel128.path.parent.parent, kernel128.dtype, kernel128.name, 96)
    assert not info.value.is_defect


def _model_with_head_dim(head_dim: int):
    """What _rows_attention_kernel reads of a loaded model: its HF config."""
    from types import SimpleNamespace

    config = SimpleNamespace(head_dim=head_dim, hidden_size=12 * head_dim, num_attention_heads=12)
    return SimpleNamespace(hf_model=SimpleNamespace(config=config))


def _best_runnable(dtype):
    from kvblend import kernels

    return next(
        (s for s in kernels.kernels_for(dtype) if set(s.cpu_flags) <= kernels.cpu_flags()), None
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_auto_picks_the_best_native_build_for_both_head_dims(dtype, head_dim, tmp_path):
    from kvblend.engine.engine import _rows_attention_kernel

    best = _best_runnable(getattr(torch, dtype))
    if best is None:
        pytest.skip(f"this CPU runs no native {dtype} build")
    cfg = ModelConfig(dtype=dtype, attention_kernel="auto", cache_dir=tmp_path)
    chosen, reason = _rows_attention_kernel(cfg, _model_with_head_dim(head_dim))
    if chosen is None:
        pytest.fail(f"auto fell back to PyTorch at head_dim {head_dim}: {reason}")
    assert (chosen.name, chosen.head_dim, reason) == (best.name, head_dim, None)
    assert _rows_attention_kernel(
        ModelConfig(dtype=dtype, attention_kernel="torch", cache_dir=tmp_path),
        _model_with_head_dim(head_dim),
    ) == (None, "attention_kernel=torch was asked for")


def test_a_broken_best_build_is_a_warning_with_its_reason(tmp_path, monkeypatch, caplog):
    """A best build that fails its self-check leaves the next build (or PyTorch) with a WARNING
    naming why, and the engine keeps that reason (/health and usage.kvblend show it); a CPU lacking
    the ISA is not a warning."""
    import logging

    from kvblend import kernels
    from kvblend.engine.engine import _rows_attention_kernel

    best = _best_runnable(torch.bfloat16)
    if best is None:
        pytest.skip("this CPU runs no native bfloat16 build")
    real = kernels._build_and_load

    def best_fails(spec, out_dir, head_dim=64):
        if spec.name == best.name:
            raise KernelUnavailable(
                f"the {spec.name} kernel failed its self-check: simulated", "selfcheck"
            )
        return real(spec, out_dir, head_dim)

    monkeypatch.setattr(kernels, "_build_and_load", best_fails)
    cfg = ModelConfig(dtype="bfloat16", attention_kernel="auto", cache_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="kvblend.engine.engine"):
        chosen, reason = _rows_attention_kernel(cfg, _model_with_head_dim(128))
    assert "simulated" in reason
    assert [r.levelno for r in caplog.records if "simulated" in r.getMessage()] == [logging.WARNING]
    assert chosen is None or chosen.name != best.name

    def cpu_lacks(spec, out_dir, head_dim=64):
        raise KernelUnavailable(
            f"this CPU lacks everything (needed by the {spec.name} kernel)", "cpu"
        )

    monkeypatch.setattr(kernels, "_build_and_load", cpu_lacks)
    cfg = ModelConfig(
        dtype="bfloat16", attention_kernel="auto", cache_dir=tmp_path / "other"
    )  # not cached
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvblend.engine.engine"):
        chosen, reason = _rows_attention_kernel(cfg, _model_with_head_dim(128))
    assert chosen is None and "lacks" in reason
    assert [r.levelno for r in caplog.records if "lacks" in r.getMessage()] == [logging.INFO]


def test_builds_and_failure_records_are_keyed_by_compiler_version(monkeypatch, tmp_path):
    from kvblend import kernels

    spec = KERNELS_BY_NAME["avx2"]
    monkeypatch.setitem(kernels._compiler_versions, "/opt/cc", "cc 1.0")
    old = kernels.build_path(spec, tmp_path, 64, "/opt/cc")
    assert kernels.build_path(spec, tmp_path, 64, "/opt/cc") == old
    assert kernels.build_path(spec, tmp_path, 128, "/opt/cc") != old
    monkeypatch.setitem(kernels._compiler_versions, "/opt/cc", "cc 1.1")  # upgraded in place
    new = kernels.build_path(spec, tmp_path, 64, "/opt/cc")
    assert new != old and new.with_suffix(".failed") != old.with_suffix(".failed")
