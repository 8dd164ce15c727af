"""Two engine processes sharing one real redis-server: the second reuses what the first computed."""

from __future__ import annotations

import json

from helpers import run_python

CHILD = """
import json, sys
from helpers import INSTRUCTION, musique_docs
from kvblend.config import EngineConfig, ModelConfig, StoreConfig
from kvblend.engine.engine import create_engine
from kvblend.engine.request import GenerationRequest, SamplingParams
from kvblend.store.factory import create_store

# a loaded CI core can stall a read past 0.3 s
store = create_store(
    StoreConfig(tiers=("memory", "redis"), redis_url={url!r}, redis_socket_timeout_s=2.0)
)
engine = create_engine(EngineConfig(model=ModelConfig(dtype="float32", num_threads=1)), store)
docs, question = musique_docs(2, 3)
segs = engine.segments(docs[::-1], question, instruction=INSTRUCTION)
res = engine.run(
    GenerationRequest(segs, SamplingParams(max_tokens=8), mode="blend", recompute_ratio=0.15)
)
store.flush(30)
print(json.dumps({{"text": res.text, "hit": res.stats.chunks_hit, "total": res.stats.chunks_total,
                  "redis": store.stats().get("redis", {{}})}}))
"""


def _run_engine(url: str) -> dict:
    out = run_python(CHILD.format(url=url), env={"PYTHONPATH": "tests"}, timeout=300)
    return json.loads(out.strip().splitlines()[-1])


def test_second_engine_process_hits_chunks_the_first_computed(redis_server):
    first = _run_engine(redis_server.url)
    assert first["hit"] == 0 and first["total"] == 3
    second = _run_engine(redis_server.url)
    assert second["hit"] == 3, second
    assert second["text"] == first["text"]
    # Redis gone: the request still succeeds, computing its chunks locally.
    redis_server.stop()
    third = _run_engine(redis_server.url)
    assert third["hit"] == 0 and third["text"] == first["text"]
