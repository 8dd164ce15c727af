"""Qwen2 on real weights (Qwen2.5-Coder-0.5B / 1.5B-Instruct Q4_K_M, fetched by `make qwen` /
`make qwen-1.5b`): slow, so few."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import INSTRUCTION, musique_docs

from kvblend.config import EngineConfig, ModelConfig
from kvblend.engine.engine import create_engine
from kvblend.engine.request import GenerationRequest, SamplingParams

QWEN = Path(os.path.expanduser("~/.cache/kvblend/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not QWEN.is_file(), reason=f"{QWEN} missing: run `make qwen`")
def test_qwen2_blend_one_equals_full_and_greedy_matches_transformers():
    engine = create_engine(
        EngineConfig(model=ModelConfig(model=str(QWEN), dtype="float32", num_threads=2))
    )
    assert engine.loaded.model_type == "qwen2"
    docs, question = musique_docs(1, 3)
    segs = engine.segments(docs[::-1], question, instruction=INSTRUCTION)
    full = engine.run(GenerationRequest(segs, SamplingParams(max_tokens=8), mode="full"))
    engine.precompute(segs.chunk_ids)
    blend = engine.run(
        GenerationRequest(segs, SamplingParams(max_tokens=1), mode="blend", recompute_ratio=1.0)
    )
    assert (blend.first_token_logits - full.first_token_logits).abs().max().item() <= 1e-3
    ids = torch.tensor([segs.token_ids])
    hf = engine.loaded.hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
    )
    hf_ids = hf[0, ids.shape[1] :].tolist()
    hf_ids = [
        t
        for t in hf_ids[
            : next((i for i, t in enumerate(hf_ids) if t in engine.eos_ids), len(hf_ids))
        ]
    ]
    assert full.token_ids == hf_ids


QWEN_1_5B = Path(
    os.path.expanduser("~/.cache/kvblend/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
)


@pytest.mark.skipif(not QWEN_1_5B.is_file(), reason=f"{QWEN_1_5B} missing: run `make qwen-1.5b`")
def test_qwen2_1_5b_blend_one_equals_full():
    """The 7B-class shape (head_dim 128, 12 query / 2 KV heads): blend@1.0 is full
    prefill, in fp32."""
    engine = create_engine(
        EngineConfig(model=ModelConfig(model=str(QWEN_1_5B), dtype="float32", num_threads=2))
    )
    assert (engine.ops.head_dim, engine.ops.num_kv_heads, engine.ops.group_size) == (128, 2, 6)
    docs = [
        "Marie Curie was born in Warsaw in 1867.",
        "She won the Nobel Prize in Physics in 1903.",
    ]
    segs = engine.segments(docs, "Where was Marie Curie born?", instruction=INSTRUCTION)
    full = engine.run(GenerationRequest(segs, SamplingParams(max_tokens=1), mode="full"))
    engine.precompute(segs.chunk_ids)
    blend = engine.run(
        GenerationRequest(segs, SamplingParams(max_tokens=1), mode="blend", recompute_ratio=1.0)
    )
    assert blend.stats.recomputed_tokens == sum(len(c) for c in segs.chunk_ids)
    assert (blend.first_token_logits - full.first_token_logits).abs().max().item() <= 1e-3
    assert blend.token_ids == full.token_ids
