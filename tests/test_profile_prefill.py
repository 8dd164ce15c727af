"""scripts/profile_prefill.py --parts / --decode-tokens: the parts of a request add up to its TTFT,
each timed part is the engine's own call (restored afterwards), and decoding is timed per token."""

from helpers import INSTRUCTION, embedded_engine, load_script, musique_docs

from kvblend.blend.blender import KernelAttention, TorchAttention
from kvblend.client.stream import parse_mode_spec
from kvblend.models.transformer import TransformerOps
from kvblend.store.memory import MemoryStore

profile = load_script("profile_prefill")


def test_parts_add_up_to_the_ttft_and_the_wrapped_calls_are_restored(monkeypatch):
    engine = embedded_engine("float32")
    monkeypatch.setattr(
        engine, "store", MemoryStore()
    )  # the shared engine's store stays as other tests left it
    docs, question = musique_docs(2, num_docs=3)
    segs = engine.segments(docs, question, instruction=INSTRUCTION)
    engine.precompute(segs.chunk_ids)
    originals = [getattr(owner, name) for _, owner, name in profile.PARTS]
    for mode in ("full", "blend@0.15"):
        table = profile.parts_table(engine, segs, parse_mode_spec(mode), "cpu", 2)
        rows = {
            line.split(" | ")[0].lstrip("| "): float(line.split(" | ")[1])
            for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| part")
        }
        ttft = float(table.split("mean TTFT ")[1].split(" ms")[0])
        # "rest" is what the timed parts leave; each printed value is rounded to 0.1 ms
        assert abs(sum(rows.values()) - ttft) <= 0.05 * (len(rows) + 1) + 1e-6, table
        assert rows["attention"] > 0 and rows["o_proj + MLP"] > 0 and rows["q/k/v"] > 0, table
        assert rows["rest (planning, selection, Python)"] >= 0, table
    assert [getattr(owner, name) for _, owner, name in profile.PARTS] == originals
    assert {owner for _, owner, _ in profile.PARTS} == {
        TransformerOps,
        KernelAttention,
        TorchAttention,
    }
    assert profile.decode_ms_per_token(engine, segs, parse_mode_spec("reuse"), 3, 1) > 0
