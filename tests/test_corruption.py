"""Issue 33 F3: damaged stored KV is always detected and recomputed, and never changes an answer.

The real embedded model over a real disk tier: chunks are precomputed once, the directory is
copied, and the same requests run against an intact copy and a copy in which every stored file is
damaged (a flipped byte in some layer's payload, in the header, or a cut-off tail). Greedy outputs
must match token by token."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import INSTRUCTION, embedded_engine, musique_docs

from kvblend.engine.request import GenerationRequest, SamplingParams
from kvblend.store.disk import SUFFIX, DiskStore
from kvblend.store.serializer import parse_header


def _requests(engine):
    """Three prompts: three documents, the same three shuffled, three others (every one a chunk)."""
    out = []
    for example, order in ((0, (0, 1, 2)), (0, (2, 0, 1)), (1, (0, 1, 2))):
        docs, question = musique_docs(example, 3)
        out.append(
            engine.segments(
                documents=[docs[i] for i in order], question=question, instruction=INSTRUCTION
            )
        )
    return out


def _answers(engine, store_dir: Path, requests) -> list[list[int]]:
    engine.store = DiskStore(store_dir)
    outs = []
    for segs in requests:
        req = GenerationRequest(
            segs, SamplingParams(max_tokens=6), mode="blend", recompute_ratio=0.15
        )
        outs.append(engine.run(req).token_ids)
    return outs


def _damage(path: Path, how: int) -> None:
    data = bytearray(path.read_bytes())
    header = parse_header(bytes(data))
    if how == 3:  # a cut-off tail
        path.write_bytes(bytes(data[: len(data) - 100]))
        return
    if how == 2:  # the header (its checksum catches it at open)
        at = 20
    else:
        # a payload byte: a middle layer, or the last one (found only after most layers were used)
        layer = header.num_layers // 2 if how == 0 else header.num_layers - 1
        off, n = header.layer_span(layer)
        at = off + n // 3
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_every_stored_file_damaged_gives_the_clean_answers(tmp_path):
    engine = embedded_engine("float32")
    saved_store, saved_defer = engine.store, dict(engine._deferred)
    try:
        requests = _requests(engine)
        engine.store = DiskStore(tmp_path / "seed")
        for segs in requests:
            engine.precompute(segs.chunk_ids)
        files = sorted((tmp_path / "seed").glob("*" + SUFFIX))
        assert len(files) == 6  # 3 + 3 documents; the shuffled prompt reuses the first three
        shutil.copytree(tmp_path / "seed", tmp_path / "clean")
        shutil.copytree(tmp_path / "seed", tmp_path / "damaged")
        for i, f in enumerate(sorted((tmp_path / "damaged").glob("*" + SUFFIX))):
            _damage(f, i % 4)

        clean = _answers(engine, tmp_path / "clean", requests)
        damaged = _answers(engine, tmp_path / "damaged", requests)
        assert damaged == clean
        assert engine.store.stats()["corrupt"] >= len(files)
        for f in files:  # every damaged entry was recomputed and stored again, intact
            data = (tmp_path / "damaged" / f.name).read_bytes()
            assert len(data) == parse_header(data).total_size
    finally:
        engine.store, engine._deferred = saved_store, saved_defer
