"""Token selections as strategies behind a registry (kvblend/blend/strategies.py): the registry, the
factory, a registered toy strategy run by the layer loop, and the built-in ones on the embedded
SmolLM2-135M (fp32 tolerance as tests/test_engine.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import INSTRUCTION, embedded_engine, musique_docs

from kvblend.blend.blender import KVCache, PrefillPlan, run_prefill
from kvblend.blend.selection import num_to_keep, select_top_tokens
from kvblend.blend.strategies import (
    SELECTIONS,
    DeviationSelection,
    LookaheadSelection,
    QuerySelection,
    SelectionStrategy,
    create_selection,
    experimental_selections,
    register_selection,
)
from kvblend.engine.request import GenerationRequest, SamplingParams
from kvblend.policy import SELECTION_KINDS, PrefillPolicy, Selection
from kvblend.store.memory import MemoryStore

FP32_ATOL = 1e-3


def test_registry_lists_every_selection_kind():
    assert set(SELECTION_KINDS) <= set(SELECTIONS)
    assert Selection.AUTO not in SELECTIONS  # the engine resolves "auto" to a kind first
    assert SELECTIONS["query"].experimental and not SELECTIONS["deviation"].experimental
    assert not SELECTIONS["lookahead"].experimental
    assert experimental_selections() == ("query", "deviation k", "deviation kv")


def test_create_selection_from_names_and_policies():
    attn = create_selection("deviation", deviation="attn")
    assert isinstance(attn, DeviationSelection) and attn.after_attention
    assert not create_selection("query", deviation="attn").after_attention  # ranks at the QKV
    assert isinstance(create_selection(PrefillPolicy.parse("blend@0.1/query")), QuerySelection)
    assert create_selection("lookahead:8").depth == 8
    policy = PrefillPolicy.parse("blend@0.1/lookahead:4")
    assert create_selection(policy).depth == 4
    assert create_selection(policy, lookahead_layers=0).depth == 0
    # a resolved policy carries a depth whatever its kind: only lookahead's is read
    deviation = PrefillPolicy.parse("blend@0.1/deviation").with_defaults("blend", 0.1, "query", 6)
    assert isinstance(create_selection(deviation), DeviationSelection)
    with pytest.raises(ValueError, match="only lookahead takes a layer count"):
        create_selection("query:4")


def test_unknown_selection_names_the_known_ones():
    for name in ("best", Selection.AUTO.value):
        with pytest.raises(ValueError, match="unknown token selection") as err:
            create_selection(name)
        assert all(kind in str(err.value) for kind in SELECTION_KINDS)
    with pytest.raises(ValueError, match="deviation must be one of"):
        create_selection("deviation", deviation="q")


def _prompt():
    """The embedded engine, a 4-document prompt and a plan over it: prefix and query computed,
    chunk rows stored as computed alone (what a blend reads), every row active from layer 0."""
    engine = embedded_engine("float32")
    engine.store = MemoryStore()
    docs, question = musique_docs(0, 4)
    segs = engine.segments(docs, question, instruction=INSTRUCTION)
    engine.precompute(segs.chunk_ids)
    ops, T = engine.ops, segs.num_tokens
    shape = (ops.num_layers, ops.num_kv_heads, T, ops.head_dim)
    stored_k = torch.zeros(shape, dtype=ops.dtype)  # [L, Hkv, T, d] pre-RoPE
    stored_v = torch.zeros(shape, dtype=ops.dtype)
    stored = torch.zeros(T, dtype=torch.bool)
    row = len(segs.prefix_ids)
    for chunk_ids in segs.chunk_ids:
        kv = engine.store.get(engine.chunk_key(chunk_ids))  # [L, Hkv, n, d]
        stored_k[:, :, row : row + len(chunk_ids)] = kv.k
        stored_v[:, :, row : row + len(chunk_ids)] = kv.v
        stored[row : row + len(chunk_ids)] = True
        row += len(chunk_ids)
    num_keep = num_to_keep(0.15, int(stored.sum()))
    plan = PrefillPlan(
        torch.tensor(segs.token_ids),
        stored_k,
        stored_v,
        stored,
        torch.arange(T),
        check_layers=(1,),
        check_keep=(num_keep,),
    )
    return engine, segs, plan


def _copy(plan, selection=None):
    """The plan on copies of its stored KV (the layer loop writes fresh rows into them)."""
    return PrefillPlan(
        plan.token_ids,
        plan.stored_k.clone(),
        plan.stored_v.clone(),
        plan.stored_mask,
        plan.active_rows,
        check_layers=plan.check_layers,
        check_keep=plan.check_keep,
        selection=selection,
        record_query_attention=plan.record_query_attention,
        num_layers=plan.num_layers,
    )


def _run(ops, plan, selection=None):
    return run_prefill(ops, _copy(plan, selection), KVCache.allocate(ops, plan.num_tokens))


def test_a_registered_strategy_is_created_and_run_at_the_check_layer():
    calls = []

    @register_selection("spy", experimental=True)
    class Spy(SelectionStrategy):
        """The base's KV deviation, recording the layers it was asked at."""

        def check_qkv(self, ops, plan, layer, *args):
            calls.append(layer)
            return super().check_qkv(ops, plan, layer, *args)

    try:
        with pytest.raises(ValueError, match="already registered"):
            register_selection("spy")(Spy)
        strategy = create_selection("spy")
        assert isinstance(strategy, Spy) and "spy" in experimental_selections()
        engine, _, plan = _prompt()
        out = _run(engine.ops, plan, strategy)
        reference = _run(engine.ops, plan, DeviationSelection("v"))
        assert calls == [1]
        assert torch.equal(out.recomputed_rows, reference.recomputed_rows)
        assert torch.equal(out.last_logits, reference.last_logits)
    finally:
        SELECTIONS.pop("spy", None)
    with pytest.raises(ValueError, match="needs a selection"):  # check layers, no strategy
        _run(engine.ops, plan)


def test_lookahead_prepare_is_the_reuse_pass_then_a_blend_without_check_layers():
    """LookaheadSelection.prepare against the algorithm written out: a reuse pass recording the
    query's attention, then the top chunk rows (and the query) computed from layer 0."""
    engine, _, plan = _prompt()
    ops = engine.ops
    for depth in (0, 6):
        strategy = LookaheadSelection(depth=depth)
        cache = KVCache.allocate(ops, plan.num_tokens)
        working = _copy(plan, strategy)
        prepared = strategy.prepare(ops, working, cache)
        got = run_prefill(ops, prepared, cache)

        query = (~plan.stored_mask).nonzero().flatten()  # prefix and query rows
        reuse = PrefillPlan(
            plan.token_ids,
            plan.stored_k,
            plan.stored_v,
            plan.stored_mask,
            query,
            record_query_attention=True,
            num_layers=depth or None,
        )
        received = _run(ops, reuse).query_attention  # [T]
        candidates = plan.stored_mask.nonzero().flatten()
        chosen = candidates[select_top_tokens(received[candidates], plan.check_keep[-1])]
        active = torch.unique(torch.cat([query, chosen]))
        blend = PrefillPlan(plan.token_ids, plan.stored_k, plan.stored_v, plan.stored_mask, active)
        expected = _run(ops, blend)
        assert prepared.check_layers == () and torch.equal(prepared.active_rows, active)
        assert torch.equal(got.last_logits, expected.last_logits)


@pytest.mark.parametrize("deviation", ["v", "k", "kv"])
def test_blend_at_ratio_one_equals_full_with_every_strategy(deviation):
    """At ratio 1.0 every chunk row is recomputed whichever strategy ranks them: blend equals full
    prefill (first-token logits within fp32 tolerance, same argmax), experimental ones included."""
    engine, segs, _ = _prompt()
    one = SamplingParams(max_tokens=1)
    full = engine.run(GenerationRequest(segs, one, mode="full")).first_token_logits
    engine.config.blend.store_blended_prefix = False
    old_deviation = engine.config.blend.deviation
    engine.config.blend.deviation = deviation
    try:
        for name in SELECTION_KINDS:
            request = GenerationRequest(
                segs, one, mode="blend", recompute_ratio=1.0, selection=name
            )
            blend = engine.run(request)
            assert blend.stats.recomputed_tokens == sum(map(len, segs.chunk_ids))
            diff = (blend.first_token_logits - full).abs().max().item()
            assert diff <= FP32_ATOL, f"blend@1.0/{name} ({deviation}) differs by {diff}"
            assert blend.first_token_logits.argmax() == full.argmax()
    finally:
        engine.config.blend.store_blended_prefix = True
        engine.config.blend.deviation = old_deviation
