"""Correctness gates for every prefill path, on the real embedded SmolLM2-135M weights.

Tolerances: fp32 last-token logits within 1e-3 absolute (observed: 0 to 2e-5); bf16 within 1.0
with the same argmax (bf16 rounding of different kernel orders moves logits by up to ~0.6 here).
The gates marked with a device run on CUDA too where a GPU is present (`pytest tests -k cuda`);
CI runs the CPU ones.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from helpers import (
    DEVICES,
    INSTRUCTION,
    embedded_engine,
    musique_docs,
    needs_cuda,
    tiny_engine,
    tiny_model_dir,
)

from kvblend.blend.blender import KVCache, PrefillPlan, create_attention, row_blocks, run_prefill
from kvblend.blend.rope import apply_rope, unapply_rope
from kvblend.blend.selection import num_to_keep
from kvblend.blend.strategies import DeviationSelection
from kvblend.config import SELECTION_KINDS, BlendConfig, EngineConfig, ModelConfig
from kvblend.engine.engine import ContextLengthError, create_engine
from kvblend.engine.kv_loader import LayerwiseLoader
from kvblend.engine.request import GenerationRequest, SamplingParams
from kvblend.models.loader import ModelLoadError
from kvblend.store.base import ChunkKV
from kvblend.store.disk import DiskStore
from kvblend.store.memory import MemoryStore
from kvblend.store.reader import KVReader, TensorReader

FP32_ATOL = 1e-3
BF16_ATOL = 1.0


def _segments(engine, order=(0, 1, 2, 3)):
    docs, question = musique_docs(0, 4)
    return engine.segments([docs[i] for i in order], question, instruction=INSTRUCTION)


@contextmanager
def blend_config(engine, **fields):
    """The engine's BlendConfig with ``fields`` replaced (check layers back to the deviation's
    default unless given) for the block."""
    old = engine.config.blend
    engine.config.blend = replace(old, **{"check_layers": (), **fields})
    try:
        yield engine
    finally:
        engine.config.blend = old


@contextmanager
def no_blended_prefix(engine):
    """Every blend request goes through selection (no reuse of an earlier request's blended KV)."""
    engine.config.blend.store_blended_prefix = False
    try:
        yield engine
    finally:
        engine.config.blend.store_blended_prefix = True


def _first(engine, segs, mode, ratio=0.15, max_tokens=1, selection=None, lookahead_layers=None):
    return engine.run(
        GenerationRequest(
            segs,
            SamplingParams(max_tokens=max_tokens),
            mode=mode,
            recompute_ratio=ratio,
            selection=selection,
            lookahead_layers=lookahead_layers,
        )
    )


@pytest.mark.parametrize(
    "dtype,atol,attention,device",
    [
        ("float32", FP32_ATOL, "auto", "cpu"),
        ("float32", FP32_ATOL, "torch", "cpu"),
        ("bfloat16", BF16_ATOL, "auto", "cpu"),
        pytest.param("float32", FP32_ATOL, "auto", "cuda", marks=needs_cuda),
        pytest.param("bfloat16", BF16_ATOL, "auto", "cuda", marks=needs_cuda),
    ],
)
def test_blend_ratio_one_equals_full(dtype, atol, attention, device):
    engine = embedded_engine(dtype, attention, device)
    engine.store = MemoryStore()
    segs = _segments(engine, order=(2, 0, 3, 1))
    full = _first(engine, segs, "full")
    engine.precompute(segs.chunk_ids)
    with no_blended_prefix(engine):
        _first(
            engine, segs, "blend", 1.0
        )  # stores the prefix, so the next run reads it from the store
        for selection, deviation in [(kind, "v") for kind in SELECTION_KINDS] + [
            ("deviation", "attn")
        ]:
            with blend_config(engine, deviation=deviation):
                blend = _first(engine, segs, "blend", 1.0, selection=selection)
            assert blend.stats.chunks_hit == 4 and blend.stats.recomputed_tokens == sum(
                map(len, segs.chunk_ids)
            )
            diff = (blend.first_token_logits - full.first_token_logits).abs().max().item()
            assert diff <= atol, (
                f"blend@1.0 ({selection} selection, {deviation}) differs from full by {diff}"
            )
            assert blend.first_token_logits.argmax() == full.first_token_logits.argmax()


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_hit_equals_full_fp32(device):
    engine = embedded_engine("float32", device=device)
    engine.store = MemoryStore()
    segs = _segments(engine)
    full = _first(engine, segs, "full")
    cold = _first(engine, segs, "prefix")
    warm = _first(engine, segs, "prefix")
    assert cold.stats.cached_tokens == 0
    assert warm.stats.cached_tokens == segs.num_tokens - len(segs.query_ids)
    for res in (cold, warm):
        assert (res.first_token_logits - full.first_token_logits).abs().max().item() <= FP32_ATOL


@pytest.mark.parametrize("device", DEVICES)
def test_reused_chunk_layer0_kv_matches_fresh_at_new_position(device):
    """Layer-0 K/V depend only on token and position: a chunk computed alone, re-positioned, equals
    the same rows computed fresh inside the full prompt."""
    engine = embedded_engine("float32", device=device)
    segs = _segments(engine, order=(3, 1, 0, 2))
    ids = torch.tensor(segs.token_ids)
    plan = PrefillPlan(
        ids, None, None, torch.zeros(len(ids), dtype=torch.bool), torch.arange(len(ids))
    )
    cache = KVCache.allocate(engine.ops, len(ids))
    out = run_prefill(engine.ops, plan, cache)
    start = len(segs.prefix_ids) + len(segs.chunk_ids[0]) + len(segs.chunk_ids[1])
    chunk = segs.chunk_ids[2]
    stored = engine._compute_chunk(chunk)  # [L, Hkv, n, d], computed at other positions
    rows = slice(start, start + len(chunk))
    cos, sin = engine.ops.rope_cos_sin(torch.arange(start, start + len(chunk)))
    torch.testing.assert_close(stored.v[0], out.fresh_v[0][:, rows], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        apply_rope(stored.k[0], cos, sin), cache.k[0][:, rows], atol=1e-5, rtol=0
    )
    # ...and deeper layers do differ (otherwise there would be nothing to blend)
    assert (stored.v[5] - out.fresh_v[5][:, rows]).abs().max() > 1e-2


@pytest.mark.parametrize(
    "attention,device",
    [("auto", "cpu"), ("torch", "cpu"), pytest.param("auto", "cuda", marks=needs_cuda)],
)
def test_exact_kv_with_any_active_subset_equals_full(attention, device):
    """With exact stored KV, computing an arbitrary subset of rows must reproduce full
    prefill: a mask letting a selected row see a later key (the bottom-right approximation)
    would change the logits. Both attention paths: the native kernel where this CPU has one,
    and PyTorch's row blocks."""
    engine = embedded_engine("float32", attention, device)
    segs = _segments(engine)
    T = segs.num_tokens
    ids = torch.tensor(segs.token_ids)
    ref_plan = PrefillPlan(ids, None, None, torch.zeros(T, dtype=torch.bool), torch.arange(T))
    ref = run_prefill(engine.ops, ref_plan, KVCache.allocate(engine.ops, T))
    gen = torch.Generator().manual_seed(0)
    active = torch.unique(
        torch.cat([torch.randperm(T, generator=gen)[: T // 7], torch.tensor([T - 1])])
    )
    plan = PrefillPlan(
        ids, ref.fresh_k.clone(), ref.fresh_v.clone(), torch.ones(T, dtype=torch.bool), active
    )
    out = run_prefill(engine.ops, plan, KVCache.allocate(engine.ops, T))
    assert (out.last_logits - ref.last_logits).abs().max().item() <= FP32_ATOL


class _SlowReader(KVReader):
    """A TensorReader that takes ``delay`` seconds per layer: the loader lags the layer loop."""

    def __init__(self, inner: TensorReader, delay: float):
        self.inner, self.delay = inner, delay
        self.num_layers, self.kv_heads, self.seq_len = (
            inner.num_layers,
            inner.kv_heads,
            inner.seq_len,
        )
        self.head_dim, self.dtype = inner.head_dim, inner.dtype

    def read_layer_bytes_into(self, layer, k_out, v_out):
        time.sleep(self.delay)
        self.inner.read_layer_bytes_into(layer, k_out, v_out)


def test_rows_computed_everywhere_still_wait_for_a_lagging_loader(tmp_path):
    """When every row is computed (blend@1 after the check layer) the loop still waits for each
    layer's load: the loader writes the same rows, and a late write would replace fresh K/V with
    stored ones. Stored layer-0 K/V is used as is (it is context-free, so a real chunk's equals a
    fresh projection): only that layer of the stand-in entry is genuine."""
    engine = tiny_engine(tiny_model_dir(tmp_path, "llama"))
    ops = engine.ops
    segs = engine.segments(["one two three " * 20, "four five six " * 25], "Question: sum?")
    ids, T = torch.tensor(segs.token_ids), segs.num_tokens
    ref = run_prefill(
        ops,
        PrefillPlan(ids, None, None, torch.zeros(T, dtype=torch.bool), torch.arange(T)),
        KVCache.allocate(ops, T),
    )
    junk = ChunkKV(
        torch.randn_like(ref.fresh_k) * 50, torch.randn_like(ref.fresh_v) * 50
    )  # must never win
    junk.k[0], junk.v[0] = ref.fresh_k[0], ref.fresh_v[0]
    cache = KVCache.allocate(ops, T)
    k_pre = torch.empty_like(ref.fresh_k)
    with LayerwiseLoader(
        [(_SlowReader(TensorReader(junk), 0.05), 0)], k_pre, cache.v[:, :, :T]
    ) as loader:
        plan = PrefillPlan(
            ids,
            k_pre,
            cache.v[:, :, :T],
            torch.ones(T, dtype=torch.bool),
            torch.arange(T),
            check_layers=(1,),
            check_keep=(T,),
            selection=DeviationSelection("v"),
            wait_layer=loader.wait_layer,
        )
        out = run_prefill(ops, plan, cache)
    assert (out.last_logits - ref.last_logits).abs().max().item() <= FP32_ATOL
    assert torch.equal(cache.v[:, :, :T], ref.fresh_v)


def test_row_blocks_mask_is_exact_causal():
    active = torch.tensor(
        [3, 4, 10, 11, 50, 51, 52, 90, 120, 121, 200, 260, 261, 300, 301, 302, 399] * 1
    )
    blocks = row_blocks(active, max_blocks=4, min_rows=2)
    assert sum(b.rows.stop - b.rows.start for b in blocks) == active.numel()
    for b in blocks:
        pos = active[b.rows]
        assert b.num_keys == int(pos[-1]) + 1
        expected = torch.arange(b.num_keys)[None, :] <= pos[:, None]
        assert torch.equal(b.mask, expected)  # never a key after the row's own position


def test_rope_repositioning_round_trip_with_rope_scaling(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    engine = tiny_engine(tiny_model_dir(tmp_path, "llama", scaling))
    ops = engine.ops
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    k = torch.randn(ops.num_kv_heads, 40, ops.head_dim)
    cos_a, sin_a = ops.rope_cos_sin(torch.arange(0, 40))
    cos_b, sin_b = ops.rope_cos_sin(
        torch.arange(700, 740)
    )  # beyond original_max: scaled frequencies
    moved = apply_rope(unapply_rope(apply_rope(k, cos_a, sin_a), cos_a, sin_a), cos_b, sin_b)
    _, hf = apply_rotary_pos_emb(k[None], k[None], cos_b[None], sin_b[None])
    torch.testing.assert_close(moved, hf[0], atol=1e-5, rtol=0)
    # and the whole engine stays exact under scaling: blend@1.0 == full
    segs = engine.segments(["alpha beta gamma " * 30, "delta epsilon " * 40], "Question: which?")
    full = _first(engine, segs, "full")
    engine.precompute(segs.chunk_ids)
    blend = _first(engine, segs, "blend", 1.0)
    assert (blend.first_token_logits - full.first_token_logits).abs().max().item() <= FP32_ATOL


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral"])
def test_other_architectures_blend_one_equals_full(tmp_path, model_type):
    engine = tiny_engine(tiny_model_dir(tmp_path, model_type))
    segs = engine.segments(
        ["one two three " * 20, "four five six " * 25, "seven " * 30], "Question: sum?"
    )
    full = _first(engine, segs, "full", max_tokens=4)
    engine.precompute(segs.chunk_ids)
    blend = _first(engine, segs, "blend", 1.0, max_tokens=4)
    assert (blend.first_token_logits - full.first_token_logits).abs().max().item() <= FP32_ATOL
    assert blend.token_ids == full.token_ids


@pytest.mark.parametrize(
    "deviation,selection",
    [
        ("v", "deviation"),
        ("kv", "deviation"),
        ("attn", "deviation"),
        ("v", "query"),
        ("v", "lookahead"),
    ],
)
def test_blend_paths_with_any_deviation_and_recycled_buffers_equal_unpooled(
    tmp_path, deviation, selection
):
    """The check layer projects only V for every row with the value deviation (Q/K for the kept
    rows), K/V for every row and Q for the query rows with the query selection, all three otherwise
    (lookahead has no check layer, and a reuse pass first); layer 0 takes stored rows' K/V as
    stored. Either way, and whether caches come from the pool or not, blend and full give what a
    pool-less engine gives, and blend@1 equals full. A live sequence's cache is never handed to
    another request; a dropped one's is."""
    model = tiny_model_dir(tmp_path, "qwen3")  # q_norm / k_norm on the partial projections too
    pooled = tiny_engine(model, deviation=deviation, selection=selection)
    unpooled = create_engine(
        EngineConfig(
            model=ModelConfig(model=str(model), dtype="float32"),
            blend=BlendConfig(deviation=deviation, selection=selection),
            buffer_pool_bytes=0,
        )
    )
    segs = unpooled.segments(
        ["one two three " * 20, "four five six " * 25, "seven " * 30], "Question: sum?"
    )
    for engine in (pooled, unpooled):
        engine.precompute(segs.chunk_ids)
    with no_blended_prefix(pooled), no_blended_prefix(unpooled):
        results = {}
        for name, engine in (("pooled", pooled), ("unpooled", unpooled)):
            # blend@0.3 twice: the pooled engine's second one runs on buffers an
            # earlier request gave back
            for mode, ratio in (("full", 1.0), ("blend", 0.3), ("blend", 1.0), ("blend", 0.3)):
                results[name, mode, ratio] = _first(engine, segs, mode, ratio, max_tokens=3)
    assert pooled.buffers.reused >= 3 and unpooled.buffers.reused == 0
    for key in [k for k in results if k[0] == "pooled"]:
        a, b = results[key], results[("unpooled",) + key[1:]]
        assert (
            torch.equal(a.first_token_logits, b.first_token_logits) and a.token_ids == b.token_ids
        )
    full, blend_one = results["pooled", "full", 1.0], results["pooled", "blend", 1.0]
    assert (blend_one.first_token_logits - full.first_token_logits).abs().max().item() <= FP32_ATOL
    live = pooled.start(
        GenerationRequest(segs, SamplingParams(max_tokens=3), mode="blend", recompute_ratio=0.3)
    )
    other = pooled.start(GenerationRequest(segs, SamplingParams(max_tokens=3), mode="full"))
    spans = [(s.cache.k.data_ptr(), s.cache.v[-1, -1, -1].data_ptr()) for s in (live, other)]
    assert spans[0][1] < spans[1][0] or spans[1][1] < spans[0][0]  # disjoint memory
    reused = pooled.buffers.reused
    del other  # dropped: its cache goes back to the pool and serves the next request
    again = pooled.start(GenerationRequest(segs, SamplingParams(max_tokens=3), mode="full"))
    assert pooled.buffers.reused > reused and again.cache.k.data_ptr() != live.cache.k.data_ptr()


def _attention_deviation_reference(ops, ids: torch.Tensor, prefix_len: int, spans) -> torch.Tensor:
    """[chunk rows] layer-0 attention output over every earlier key vs over the prefix and the row's
    own chunk placed right after it, computed with PyTorch's SDPA and dense masks (fp32). With the
    native kernel the engine ranks by one query head of each KV group, and so does this."""
    h = ops.embed(ids)
    q, k, v = ops.qkv(0, h)  # [H, T, d] pre-RoPE; layer 0 needs no context
    T = ids.numel()
    if getattr(create_attention(ops, T), "head_subsets", False):
        q = q[:: ops.group_size]
    cos, sin = ops.rope_cos_sin(torch.arange(T))
    full = ops.attend(
        apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, None
    )  # [T, Hq * d], causal
    out = []
    for start, end in spans:
        rows = torch.cat([torch.arange(prefix_len), torch.arange(start, end)])
        n = rows.numel()
        local = ops.attend(
            apply_rope(q[:, rows], cos[:n], sin[:n]),
            apply_rope(k[:, rows], cos[:n], sin[:n]),
            v[:, rows],
            None,
        )[prefix_len:]
        out.append((full[start:end] - local).pow(2).sum(-1))
    return torch.cat(out)


def test_attention_check_keeps_the_rows_the_other_chunks_move_most():
    """Deviation "attn" at check layer 0: the kept chunk rows are the top ones by how far their
    attention output over every key lies from their attention over the prefix and their own
    chunk; the rest skip layer 0's o_proj and MLP and every later layer. Checked against SDPA
    with dense masks (fp32)."""
    engine = embedded_engine("float32")
    engine.store = MemoryStore()
    ops = engine.ops
    segs = _segments(engine, order=(1, 3, 0, 2))
    engine.precompute(segs.chunk_ids)
    T, P = segs.num_tokens, len(segs.prefix_ids)
    ids = torch.tensor(segs.token_ids)
    shape = (ops.num_layers, ops.num_kv_heads, T, ops.head_dim)
    stored_k, stored_v = torch.zeros(shape), torch.zeros(shape)
    stored, spans, row = torch.zeros(T, dtype=torch.bool), [], P
    for chunk_ids in segs.chunk_ids:
        kv = engine.store.get(engine.chunk_key(chunk_ids))
        stored_k[:, :, row : row + len(chunk_ids)], stored_v[:, :, row : row + len(chunk_ids)] = (
            kv.k,
            kv.v,
        )
        spans.append((row, row + len(chunk_ids)))
        row += len(chunk_ids)
    stored[P:row] = True  # the prefix and the query are computed
    num_keep = num_to_keep(0.15, row - P)
    plan = PrefillPlan(
        ids,
        stored_k,
        stored_v,
        stored,
        torch.arange(T),
        check_layers=(0,),
        check_keep=(num_keep,),
        selection=DeviationSelection("attn"),
        chunk_spans=tuple(spans),
        prefix_len=P,
    )
    got = set(run_prefill(ops, plan, KVCache.allocate(ops, T)).recomputed_rows.tolist())
    dev = _attention_deviation_reference(ops, ids, P, spans)
    expected = set((torch.topk(dev, num_keep).indices + P).tolist())
    assert (
        len(got) == num_keep and len(got & expected) >= num_keep - 2
    )  # fp32 ties at the cut may swap
    with pytest.raises(
        ValueError, match="chunk_spans"
    ):  # a plan that cannot say what a row's chunk is
        run_prefill(ops, replace(plan, chunk_spans=tuple(spans[1:])), KVCache.allocate(ops, T))
    with no_blended_prefix(engine), blend_config(engine, deviation="attn", selection="deviation"):
        blend = _first(engine, segs, "blend", 0.15)
    assert blend.stats.recomputed_tokens == num_keep and blend.stats.chunks_hit == 4


def test_blended_prefix_is_reused_by_the_next_question():
    """Same instruction + documents, new question: the earlier blend's chunk KV (chained keys) is
    reused as is, and gives what blending from scratch gives (deviation's rows never depend on the
    query; lookahead's do)."""
    engine = embedded_engine("float32")
    engine.store = MemoryStore()
    docs, _ = musique_docs(3, 4)
    first = engine.segments(docs, "Question: who is mentioned first?", instruction=INSTRUCTION)
    second = engine.segments(docs, "Question: which year appears?", instruction=INSTRUCTION)
    engine.precompute(first.chunk_ids)
    _first(engine, first, "blend", 0.15, selection="deviation")
    reused = _first(engine, second, "blend", 0.15, selection="deviation")
    assert reused.stats.chunks_hit == 4 and reused.stats.recomputed_tokens == 0
    assert reused.stats.fresh_tokens == len(second.query_ids)
    with no_blended_prefix(engine):
        scratch = _first(engine, second, "blend", 0.15, selection="deviation")
    assert scratch.stats.recomputed_tokens > 0
    assert (reused.first_token_logits - scratch.first_token_logits).abs().max().item() <= FP32_ATOL
    # another selection blends other rows: it never takes the deviation selection's blended KV
    other = _first(engine, second, "blend", 0.15, selection="query")
    assert (
        other.stats.chunks_hit == 4
        and other.stats.recomputed_tokens == scratch.stats.recomputed_tokens
    )


def test_missing_chunks_are_prefilled_in_context_then_stored():
    """A cold blend request costs one normal prefill (its missing chunks are computed in context, so
    ratio plays no role and logits equal full); the chunks are stored after it, so
    the next one hits."""
    engine = embedded_engine("float32")
    engine.store = MemoryStore()
    segs = _segments(engine, order=(3, 2, 1, 0))
    full = _first(engine, segs, "full")
    with no_blended_prefix(engine):
        cold = _first(engine, segs, "blend", 0.15)
        assert cold.stats.chunks_hit == 0 and cold.stats.fresh_tokens == segs.num_tokens
        assert (cold.first_token_logits - full.first_token_logits).abs().max().item() <= FP32_ATOL
        assert not engine.has_deferred  # run() computed them after the request
        warm = _first(engine, segs, "blend", 0.15)
    assert warm.stats.chunks_hit == 4 and warm.stats.recomputed_tokens > 0


def test_deferred_chunks_computed_a_layer_at_a_time_equal_chunks_computed_at_once():
    """Deferred chunk work paused after every layer (run_deferred with no time to spare), with a
    decoding step and another request's prefill between its calls, stores exactly the KV a
    chunk computed in one go has: pausing loses nothing, and nothing it holds is shared."""
    engine = embedded_engine("float32")
    engine.store = MemoryStore()
    segs = _segments(engine, order=(3, 2, 1, 0))
    with no_blended_prefix(engine):
        seq = engine.start(
            GenerationRequest(
                segs, SamplingParams(max_tokens=4), mode="blend", recompute_ratio=0.15
            )
        )
        calls = 0
        while engine.has_deferred:
            assert engine.run_deferred(0.0) in (0, 1)  # one layer a call: at most one chunk ends
            calls += 1
            if calls == 5:
                engine.step([seq])
            if calls == 7:  # another request in between (its chunks are missing too: deferred)
                other = _segments(engine, order=(0, 1))
                engine.start(GenerationRequest(other, SamplingParams(max_tokens=1), mode="full"))
    # a layer a call, then one call that stores the last chunk (a chunk is known done at its end)
    assert calls == len(segs.chunk_ids) * engine.ops.num_layers + 1
    for ids in segs.chunk_ids:
        stored, fresh = engine.store.get(engine.chunk_key(ids)), engine._compute_chunk(ids)
        assert torch.equal(stored.k, fresh.k) and torch.equal(stored.v, fresh.v)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_decoding_matches_transformers_generate(device):
    engine = embedded_engine("float32", device=device)
    segs = _segments(engine)
    ours = engine.run(
        GenerationRequest(segs, SamplingParams(max_tokens=16, ignore_eos=True), mode="full")
    )
    ids = torch.tensor([segs.token_ids], device=device)
    hf = engine.loaded.hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=16,
        do_sample=False,
        min_new_tokens=16,
    )
    assert ours.token_ids == hf[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_batched_decode_matches_single(device):
    engine = embedded_engine("float32", device=device)
    a = _segments(engine, order=(0, 1))
    b = engine.segments(["A short passage about rivers."], "Question: what is it about?")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    single = [engine.run(GenerationRequest(s, params, mode="full")).token_ids for s in (a, b)]
    seqs = [engine.start(GenerationRequest(s, params, mode="full")) for s in (a, b)]
    while any(s.pending or not s.finished for s in seqs):
        engine.step(seqs)
    assert [s.generated for s in seqs] == single


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_kv_through_the_disk_tier_gives_the_same_blend(tmp_path, device):
    """Chunk KV written to disk (serialized from the engine's device) and read back into the
    prompt's buffers gives the logits the in-memory entries give."""
    engine = embedded_engine("float32", device=device)
    segs = _segments(engine, order=(1, 3, 0, 2))
    results = []
    with no_blended_prefix(engine):
        for store in (MemoryStore(), DiskStore(tmp_path)):
            engine.store = store
            engine.precompute(segs.chunk_ids)
            results.append(_first(engine, segs, "blend", 0.15))
    memory, disk = results
    assert disk.stats.chunks_hit == 4
    assert (disk.first_token_logits - memory.first_token_logits).abs().max().item() <= FP32_ATOL


@needs_cuda
def test_cuda_prefill_matches_cpu():
    """The same prompt on CUDA and on the CPU (fp32): full prefill within 1e-2 of each other, and
    blend@0.15 on each picks nearly the same rows (first-token KL between the two under 0.01)."""
    segs = _segments(embedded_engine("float32"), order=(2, 3, 1, 0))
    outs = {}
    for device in ("cpu", "cuda"):
        engine = embedded_engine("float32", device=device)
        engine.store = MemoryStore()
        engine.precompute(segs.chunk_ids)
        with no_blended_prefix(engine):
            outs[device] = [
                _first(engine, segs, mode).first_token_logits.cpu() for mode in ("full", "blend")
            ]
    (cpu_full, cpu_blend), (cuda_full, cuda_blend) = outs["cpu"], outs["cuda"]
    assert (cuda_full - cpu_full).abs().max().item() <= 1e-2
    kl = torch.nn.functional.kl_div(
        cuda_blend.log_softmax(-1), cpu_blend.log_softmax(-1), log_target=True, reduction="sum"
    ).item()
    assert kl < 0.01, f"blend@0.15 first-token KL between CUDA and CPU: {kl}"


def test_blend_quality_sits_between_reuse_and_full():
    engine = embedded_engine("float32")
    engine.store = MemoryStore()
    segs = _segments(engine, order=(1, 3, 0, 2))
    full = _first(engine, segs, "full")
    engine.precompute(segs.chunk_ids)
    p_full = torch.softmax(full.first_token_logits, -1)

    def kl(res):
        return torch.sum(
            p_full * (torch.log(p_full + 1e-12) - torch.log_softmax(res.first_token_logits, -1))
        ).item()

    with no_blended_prefix(engine):
        kl_reuse = kl(_first(engine, segs, "reuse"))
        kl_blend = kl(_first(engine, segs, "blend", 0.3))
        stats = _first(engine, segs, "blend", 0.15).stats
    assert kl_blend < kl_reuse
    chunk_tokens = sum(map(len, segs.chunk_ids))
    assert stats.recomputed_tokens == pytest.approx(0.15 * chunk_tokens, abs=1)
    assert stats.prompt_tokens == stats.reused_tokens + stats.recomputed_tokens + stats.fresh_tokens


def test_query_selection_keeps_the_chunk_rows_the_query_attends_to_most(monkeypatch):
    """Layer 0 is context-free and every chunk row is computed there, so at check layer 1 every
    row's input, and the query rows' attention, are what full prefill gives. The rows the query
    selection keeps must be the chunk rows that attention (summed over heads and query rows,
    recomputed here from transformers' own layer-1 modules) favours most."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    import kvblend.engine.engine as engine_module

    engine = embedded_engine("float32")
    engine.store = MemoryStore()
    segs = _segments(engine, order=(2, 3, 0, 1))
    engine.precompute(segs.chunk_ids)
    outputs, real_prefill = [], engine_module.run_prefill

    def recording_prefill(
        *args,
    ):  # the real layer loop; keeps its output for the rows it recomputed
        outputs.append(real_prefill(*args))
        return outputs[-1]

    monkeypatch.setattr(engine_module, "run_prefill", recording_prefill)
    with no_blended_prefix(engine):
        _first(engine, segs, "blend", 0.15, selection="query")
    kept = outputs[-1].recomputed_rows  # [K] rows, sorted

    hf = engine.loaded.hf_model
    T, num_query = segs.num_tokens, len(segs.query_ids)
    ids = torch.tensor([segs.token_ids])
    with torch.inference_mode():
        h1 = hf(ids, output_hidden_states=True).hidden_states[1]  # [1, T, D]: layer 1's input
        attn = hf.model.layers[1].self_attn
        x = hf.model.layers[1].input_layernorm(h1)
        cfg = hf.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        q = attn.q_proj(x).view(1, T, cfg.num_attention_heads, head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, T, cfg.num_key_value_heads, head_dim).transpose(1, 2)
        cos, sin = hf.model.rotary_emb(x, torch.arange(T)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, dim=1)
        scores = (q[0, :, T - num_query :] @ k[0].transpose(-1, -2)) * head_dim**-0.5  # [Hq, Q, T]
        causal = torch.arange(T)[None, :] <= torch.arange(T - num_query, T)[:, None]
        received = scores.masked_fill(~causal, float("-inf")).softmax(-1).sum(dim=(0, 1))  # [T]
    chunk_rows = torch.arange(len(segs.prefix_ids), T - num_query)
    assert kept.numel() == num_to_keep(0.15, chunk_rows.numel())
    dropped = chunk_rows[~torch.isin(chunk_rows, kept)]
    # the kept rows are the top of the reference ranking (ties at the boundary within float error)
    assert received[kept].min() >= received[dropped].max() - 1e-5


@pytest.mark.parametrize("num_layers", [None, 3])
def test_recorded_query_attention_equals_transformers_attention_weights(num_layers):
    """The lookahead selection's ranking: attention each key receives, summed over layers, heads and
    computed rows (at the last layer only the last row is computed), against transformers' eager
    attention weights of the same prompt. A pass of the first 3 layers sums those layers only and
    gives no logits."""
    engine = embedded_engine("float32")
    segs = _segments(engine, order=(1, 0))
    T = segs.num_tokens
    ids = torch.tensor(segs.token_ids)
    plan = PrefillPlan(
        ids,
        None,
        None,
        torch.zeros(T, dtype=torch.bool),
        torch.arange(T),
        record_query_attention=True,
        num_layers=num_layers,
    )
    out = run_prefill(engine.ops, plan, KVCache.allocate(engine.ops, T))
    received = out.query_attention  # [T]
    hf = engine.loaded.hf_model
    implementation = hf.config._attn_implementation
    hf.set_attn_implementation("eager")  # the only one that returns attention weights
    try:
        with torch.inference_mode():
            weights = torch.stack(
                [a[0] for a in hf(ids[None], output_attentions=True).attentions]
            )  # [L, H, T, T]
    finally:
        hf.set_attn_implementation(implementation)
    if num_layers is None:
        reference = weights[:-1].sum(dim=(0, 1, 2)) + weights[-1, :, -1].sum(dim=0)
    else:
        reference = weights[:num_layers].sum(dim=(0, 1, 2))
        assert out.last_logits is None
    assert (received - reference).abs().max().item() <= 1e-5 * reference.max().item()


def test_kernel_key_mass_records_what_the_pytorch_recorder_does(monkeypatch):
    """In bf16 the attention kernel sums each key's probability in the attention call itself
    (key_mass); the PyTorch recorder recomputes the probabilities from the same queries and
    cached keys. They differ by the rounding of the rotated queries (the kernel's bf16 of an fp32
    rotation, PyTorch's bf16 rotation): within 1% of the largest entry, and 95% of the top 15%
    are the same keys."""
    import kvblend.blend.blender as blender

    engine = embedded_engine("bfloat16")
    if (
        not isinstance(create_attention(engine.ops, 8), blender.KernelAttention)
        or not engine.ops.rows_attention.has_key_mass
    ):
        pytest.skip("no attention kernel that records key mass here")
    segs = _segments(engine, order=(2, 0, 1))
    T, num_layers = segs.num_tokens, 4
    plan = PrefillPlan(
        torch.tensor(segs.token_ids),
        None,
        None,
        torch.zeros(T, dtype=torch.bool),
        torch.arange(T),
        record_query_attention=True,
        num_layers=num_layers,
    )
    kernel = run_prefill(engine.ops, plan, KVCache.allocate(engine.ops, T)).query_attention
    monkeypatch.setattr(blender.KernelAttention, "records_key_mass", False)
    pytorch = run_prefill(engine.ops, plan, KVCache.allocate(engine.ops, T)).query_attention
    assert kernel.sum().item() == pytest.approx(num_layers * T * engine.ops.num_heads, rel=1e-3)
    assert (kernel - pytorch).abs().max().item() <= 1e-2 * pytorch.max().item()
    num_top = T * 15 // 100
    overlap = set(kernel.topk(num_top).indices.tolist()) & set(
        pytorch.topk(num_top).indices.tolist()
    )
    assert len(overlap) >= 0.95 * num_top


def test_a_pass_stopped_early_must_only_record_the_query_attention():
    engine = embedded_engine("float32")
    T, L = 8, engine.ops.num_layers
    record = {"record_query_attention": True}
    cases = [
        ({"num_layers": 2}, "only records"),
        (
            {"num_layers": 2, "check_layers": (1,), "check_keep": (2,), **record},
            "without check layers",
        ),
        ({"check_layers": (1,), "check_keep": (2,), **record}, "without check layers"),
        ({"num_layers": 0, **record}, "num_layers must be in"),
        ({"num_layers": L + 1, **record}, "num_layers must be in"),
    ]
    for kwargs, message in cases:
        plan = PrefillPlan(
            torch.arange(T), None, None, torch.zeros(T, dtype=torch.bool), torch.arange(T), **kwargs
        )
        with pytest.raises(ValueError, match=message):
            run_prefill(engine.ops, plan, KVCache.allocate(engine.ops, T))


@pytest.mark.parametrize(
    "configured,requested,pass_layers", [(0, None, None), (6, None, 6), (6, 4, 4)]
)
def test_lookahead_recomputes_the_rows_a_reuse_pass_finds_most_attended(
    monkeypatch, configured, requested, pass_layers
):
    """lookahead = a reuse pass recording the query's attention (over every layer, or the first
    BlendConfig.lookahead_layers, which a request may override), then a blend recomputing from
    layer 0 the chunk rows that attention ranks highest (and the query); accounting counts
    them as recomputed."""
    import kvblend.blend.strategies as strategies_module
    import kvblend.engine.engine as engine_module

    engine = embedded_engine("float32")
    monkeypatch.setattr(engine.config.blend, "lookahead_layers", configured)
    engine.store = MemoryStore()
    segs = _segments(engine, order=(3, 1, 2, 0))
    engine.precompute(segs.chunk_ids)
    plans, outputs, real_prefill = [], [], engine_module.run_prefill

    def recording_prefill(
        ops, plan, cache
    ):  # the real layer loop; keeps what it was given and gave
        plans.append(plan)
        outputs.append(real_prefill(ops, plan, cache))
        return outputs[-1]

    monkeypatch.setattr(engine_module, "run_prefill", recording_prefill)
    # the reuse pass runs in LookaheadSelection.prepare
    monkeypatch.setattr(strategies_module, "run_prefill", recording_prefill)
    _first(engine, segs, "reuse")  # stores the prefix: the reuse pass computes exactly the query
    plans.clear(), outputs.clear()
    with no_blended_prefix(engine):
        result = _first(
            engine, segs, "blend", 0.15, selection="lookahead", lookahead_layers=requested
        )
    (reuse_pass, blend_pass), num_query = plans, len(segs.query_ids)
    assert reuse_pass.active_rows.tolist() == list(
        range(segs.num_tokens - num_query, segs.num_tokens)
    )
    assert reuse_pass.num_layers == pass_layers
    assert blend_pass.check_layers == () and outputs[1].query_attention is None
    received, kept = outputs[0].query_attention, outputs[1].recomputed_rows
    chunk_rows = torch.arange(len(segs.prefix_ids), segs.num_tokens - num_query)
    assert kept.numel() == num_to_keep(0.15, chunk_rows.numel()) == result.stats.recomputed_tokens
    assert blend_pass.active_rows.tolist() == sorted(
        kept.tolist() + reuse_pass.active_rows.tolist()
    )
    dropped = chunk_rows[~torch.isin(chunk_rows, kept)]
    assert received[kept].min() >= received[dropped].max()


def test_stop_strings_and_sampling_seed():
    engine = embedded_engine("float32")
    segs = engine.segments([], "Write one sentence about the sea.")
    free = engine.run(
        GenerationRequest(segs, SamplingParams(max_tokens=16, ignore_eos=True), mode="full")
    )
    stop = free.text[
        len(free.text) // 2 : len(free.text) // 2 + 3
    ]  # a string the greedy output contains
    res = engine.run(
        GenerationRequest(segs, SamplingParams(max_tokens=16, stop=[stop]), mode="full")
    )
    assert res.finish_reason == "stop" and res.text == free.text[: free.text.find(stop)]
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    r1 = engine.run(GenerationRequest(segs, p, mode="full")).token_ids
    r2 = engine.run(GenerationRequest(segs, p, mode="full")).token_ids
    assert r1 == r2


def test_bad_input_is_rejected_and_leaves_store_clean():
    engine = embedded_engine("float32")
    engine.store = MemoryStore()
    segs = _segments(engine)
    empty = engine.segments([], "")
    empty.prefix_ids, empty.query_ids = [], []
    with pytest.raises(ValueError, match="empty prompt"):
        _first(engine, empty, "full")
    with pytest.raises(ValueError, match="unknown prefill mode"):
        _first(engine, segs, "turbo")
    with pytest.raises(ValueError, match=r"within \[0, 1\]"):
        _first(engine, segs, "blend", 1.5)
    with pytest.raises(
        ValueError,
        match="unknown token selection 'best'; expected one of deviation, query, lookahead",
    ):
        _first(engine, segs, "blend", 0.15, selection="best")
    with pytest.raises(ContextLengthError, match="maximum context length is 8192"):
        engine.run(GenerationRequest(segs, SamplingParams(max_tokens=8192), mode="blend"))
    huge = [1000 + (i % 500) for i in range(9000)]
    with pytest.raises(ValueError, match="exceeds the context window of 8192"):
        engine.precompute([huge])
    # nothing half-computed was stored by the failed requests
    assert not any(engine.store.contains(engine.chunk_key(c)) for c in segs.chunk_ids + [huge])


def test_unknown_architecture_is_a_clear_error(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        tiny_engine(tmp_path)


def test_auto_dtype_is_bf16_only_where_it_is_native(monkeypatch):
    """bf16 is emulated (several times slower than fp32) on CPUs without AMX / AVX-512 BF16: auto
    picks it on CUDA, AMX and AVX-512 BF16 (Zen 4) only."""
    import kvblend.config as config
    from kvblend.config import ModelConfig, resolve_dtype

    monkeypatch.setattr(config, "cpu_flags", lambda: {"avx2", "fma"})
    assert ModelConfig().dtype == "float32"
    assert resolve_dtype("auto", "cuda:0") == "bfloat16"
    monkeypatch.setattr(config, "cpu_flags", lambda: {"avx512f", "amx_tile", "amx_bf16"})
    assert ModelConfig().dtype == "bfloat16"
    monkeypatch.setattr(config, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert ModelConfig(dtype="auto").dtype == "bfloat16"
    monkeypatch.setattr(
        config, "cpu_flags", lambda: {"avx512f", "avx2", "fma"}
    )  # AVX-512 without BF16
    assert ModelConfig(dtype="auto").dtype == "float32"
    assert ModelConfig(dtype="bfloat16").dtype == "bfloat16"
    assert ModelConfig(dtype="float32").dtype == "float32"  # explicit choices are kept
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelConfig(dtype="int8")


@pytest.mark.parametrize(
    "num_rows,max_rows",
    [(16, 4096), (4096, 4096), (4112, 4096), (6256, 4096), (6256, 2048), (20000, 4096), (33, 16)],
)
def test_mlp_row_blocks_cover_every_row_once(num_rows, max_rows, monkeypatch):
    from kvblend.models import transformer

    monkeypatch.setitem(transformer.MLP_MAX_ROWS, torch.float32, max_rows)
    blocks = transformer.mlp_row_blocks(num_rows, torch.float32)
    covered = [r for b in blocks for r in range(b.start, b.stop)]
    assert covered == list(range(num_rows))
    assert all(b.stop - b.start <= max_rows for b in blocks)
    assert all((b.stop - b.start) % 16 == 0 for b in blocks[:-1])
    assert len(blocks) == -(-num_rows // max_rows)  # as few blocks as the limit allows


def test_mlp_in_row_blocks_equals_one_call(tmp_path, monkeypatch):
    """A long prompt's MLP runs in row blocks (faster on the CPU past ~5k rows); rows
    are independent there, so blocked and whole give the same hidden rows (fp32, within
    1e-6) for every layer."""
    from kvblend.models import transformer

    ops = tiny_engine(tiny_model_dir(tmp_path, "llama")).ops
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(100, ops.config.hidden_size, generator=gen)
    attn = torch.randn(100, ops.num_heads * ops.head_dim, generator=gen)
    whole = [ops.finish_layer(i, h, attn) for i in range(ops.num_layers)]
    monkeypatch.setitem(transformer.MLP_MAX_ROWS, torch.float32, 32)
    assert len(transformer.mlp_row_blocks(100, torch.float32)) == 4
    for i in range(ops.num_layers):
        torch.testing.assert_close(ops.finish_layer(i, h, attn), whole[i], atol=1e-6, rtol=0)


def test_default_selection_is_the_family_s_measured_best():
    """BlendConfig's default selection is auto: a Llama model runs lookahead@0.1 where nothing
    names a ratio; a ratio in the config or the request keeps lookahead; an explicit selection
    without a ratio runs the paper's 0.15."""
    engine = embedded_engine("float32")
    assert engine.loaded.model_type == "llama"
    assert engine.default_policy.label == "blend@0.1/lookahead"
    engine.store = MemoryStore()
    segs = _segments(engine, order=(0, 2, 1, 3))
    engine.precompute(segs.chunk_ids)
    chunk_tokens = sum(map(len, segs.chunk_ids))
    with no_blended_prefix(engine):
        stats = _first(engine, segs, "blend", ratio=None).stats
        assert (stats.selection, stats.recompute_ratio) == ("lookahead", 0.1)
        assert stats.recomputed_tokens == pytest.approx(0.1 * chunk_tokens, abs=1)
        stats = _first(engine, segs, "blend", ratio=0.2).stats
        assert (stats.selection, stats.recompute_ratio) == ("lookahead", 0.2)
        stats = _first(engine, segs, "blend", ratio=None, selection="deviation").stats
        assert (stats.selection, stats.recompute_ratio) == ("deviation", 0.15)
        with blend_config(engine, recompute_ratio=0.3):
            assert engine.default_policy.label == "blend@0.3/lookahead"
        with blend_config(engine, selection="deviation"):
            assert engine.default_policy.label == "blend@0.15/deviation"
