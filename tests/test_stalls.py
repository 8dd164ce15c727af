"""Issue 33 F6: one tenant's big request does not stall the others, and abandoned work stops.

A real `kvblend serve` (embedded model). What is asserted is order, not speed: a small request
finishes while a big one is still being worked on, and an abandoned /v1/chunks call stops short of
its documents. The delays measured are printed for the report (speed targets live in benchmarks)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from helpers import FakeEngine

from kvblend.config import ModelEntry, ServerConfig
from kvblend.server.backends import LocalBackend

MODEL = "smollm2-135m-instruct"


def _docs(tag: str, n: int) -> list[str]:
    return [
        f"Note {tag}-{i}: the {tag} archive lists item {i} as a brass compass from {1800 + i}."
        for i in range(n)
    ]


def _small_chat(base_url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(
        base_url + "/v1/chat/completions",
        timeout=120,
        json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def _in_background(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        t0 = time.perf_counter()
        try:
            out["result"] = fn()
        except Exception as e:  # noqa: BLE001 - reported by the test
            out["error"] = e
        out["done_at"], out["took"] = time.perf_counter(), time.perf_counter() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.fixture(scope="module")
def server(kvblend_server_factory):
    return kvblend_server_factory({"models": [{"id": MODEL, "model": ""}]})


@pytest.mark.slow
def test_big_requests_do_not_stall_a_small_one(server):
    base = _small_chat(server.base_url)  # warm: the first request pays one-time costs
    base = min(base, _small_chat(server.base_url))
    big = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"a" * (20 << 20) + b'"}'
    t0 = time.perf_counter()
    r = httpx.post(
        server.base_url + "/v1/completions",
        content=big,
        timeout=120,
        headers={"content-type": "application/json"},
    )
    body_413 = time.perf_counter() - t0
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    thread, chunks = _in_background(
        lambda: httpx.post(
            server.base_url + "/v1/chunks", timeout=300, json={"documents": _docs("big", 24)}
        )
    )
    time.sleep(1.0)  # the precompute is under way
    small = _small_chat(server.base_url)
    small_done = time.perf_counter()
    thread.join(300)
    assert "error" not in chunks and chunks["result"].status_code == 200, chunks
    assert small_done < chunks["done_at"], "the small request waited for the whole /v1/chunks call"
    print(
        f"\n20 MB body: 413 after {body_413 * 1e3:.0f} ms; small chat alone {base * 1e3:.0f} ms, "
        f"beside 24-document /v1/chunks {small * 1e3:.0f} ms (that call took "
        f"{chunks['took']:.1f} s)"
    )


@pytest.mark.slow
def test_abandoned_chunks_call_stops(server):
    docs = _docs("gone", 60)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/chunks", json={"documents": docs}, timeout=1.5)
    time.sleep(2.0)  # the slice in flight when the client left finishes
    r = httpx.post(server.base_url + "/v1/chunks", json={"documents": docs[:1]}, timeout=120)
    assert r.status_code == 200
    r = httpx.post(server.base_url + "/v1/chunks", json={"documents": docs}, timeout=300)
    cached = sum(d["cached"] for d in r.json()["data"])
    assert cached < len(docs) // 2, (
        f"{cached} of {len(docs)} documents were computed after the client left"
    )
    print(f"\nabandoned /v1/chunks: {cached} of {len(docs)} documents computed")


@pytest.mark.slow
def test_abandoned_generation_stops(server):
    """A client that gives up on a long non-streamed answer frees its sequence (both APIs)."""
    long = {
        "model": MODEL,
        "max_tokens": 3000,
        "messages": [
            {"role": "user", "content": "Write a very long story about a lighthouse keeper."}
        ],
    }
    for path in ("/v1/messages", "/v1/chat/completions"):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + path, json=long, timeout=2.0)
        deadline = time.monotonic() + 10
        while _active_sequences(server.base_url) > 0:
            assert time.monotonic() < deadline, (
                f"{path}: the generation kept running after the client left"
            )
            time.sleep(0.2)


def _active_sequences(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("kvblend_active_sequences")
    )


def test_precompute_is_sliced_and_stops_when_cancelled():
    """At the backend: one worker turn per slice, and a cancelled call submits no further slice."""
    engine = FakeEngine()
    calls: list[int] = []
    gate = threading.Event()

    def precompute(chunks, namespace=""):
        calls.append(len(chunks))
        gate.wait(5)
        return [{"key": "k", "num_tokens": len(c), "cached": False} for c in chunks]

    engine.precompute = precompute
    cfg = ServerConfig(models=[ModelEntry(id="fake")], precompute_slice=3)
    backend = LocalBackend(cfg.models[0], None, cfg, engine=engine)
    backend.start()
    try:

        async def run():
            task = asyncio.ensure_future(backend.precompute([f"doc {i}" for i in range(12)], ""))
            while not calls:
                await asyncio.sleep(0.01)
            task.cancel()
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.2)
            gate.clear()
            gate.set()
            return await backend.precompute(["a", "b", "c", "d"], "")

        result = asyncio.run(run())
        assert (
            calls == [3, 3, 1] and len(result) == 4
        )  # the cancelled call stopped after its first slice
    finally:
        backend.close()
