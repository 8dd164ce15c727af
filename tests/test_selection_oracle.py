"""scripts/selection_oracle.py: its variants run the engine's real layer loop, so at ratio 1 every
one of them must give full prefill's logits (fp32), and its reference KV must be full prefill's."""

import torch
from helpers import INSTRUCTION, embedded_engine, load_script, musique_docs

from kvblend.blend.selection import num_to_keep
from kvblend.store.memory import MemoryStore

oracle = load_script("selection_oracle")


def test_every_variant_at_ratio_one_equals_full_and_stored_kv_deviates_only_in_chunks(monkeypatch):
    engine = embedded_engine("float32")
    monkeypatch.setattr(
        engine, "store", MemoryStore()
    )  # the shared engine's store stays as other tests left it
    docs, question = musique_docs(1, num_docs=3)
    segs = engine.segments(docs, question, instruction=INSTRUCTION)
    with torch.inference_mode():
        p = oracle.Prompt(engine, segs)
        num_all = num_to_keep(1.0, p.chunk_rows.numel())
        gen = torch.Generator().manual_seed(0)
        for variant in (*oracle.VARIANTS, "lookahead:2", "starts4+lookahead:2"):
            logits = oracle.variant_logits(p, variant, num_all, gen)
            assert (logits - p.full_logits).abs().max() < 1e-3, variant
        # layer 0 is context-free: stored chunk KV equals full prefill's there, and
        # differs from layer 1 on
        dev = ((p.full_v - p.stored_v) ** 2).sum(dim=(1, 3))  # [L, T]
        assert float(dev[0].max()) < 1e-8
        assert float(dev[1:, p.chunk_rows].mean()) > 1e-4
        assert (
            float(dev[:, : p.chunk_rows[0]].max()) == 0.0
            and float(dev[:, p.query_rows].max()) == 0.0
        )
        assert p.deviation().shape == p.chunk_rows.shape
