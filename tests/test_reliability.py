"""Issue 33 without a model: bad input is a 4xx in the endpoint's shape, precedence is the
same on every endpoint, upstream keys never come back, /health hides upstream addresses,
limits answer at once.

The app is the real one (gate, routes, scheduler) over test_server_unit's stand-in engine; upstreams
are httpx.MockTransport stand-ins as in test_gateway_unit."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers import CLIENT_KEY as KEY  # noqa: E402
from helpers import FakeEngine
from helpers import make_keyed_client as make_client  # noqa: E402

from kvblend.config import ApiKey, ModelEntry, ServerConfig
from kvblend.server.app import create_app
from kvblend.server.backends import LocalBackend
from kvblend.server.upstream import UpstreamBackend

AUTH = {"Authorization": f"Bearer {KEY}"}
UP_KEY = "sk-Zq81LxV0wQ-7f3e9a2b4c6d5e8f"
USER = [{"role": "user", "content": "hello there"}]
POST_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/chunks", "/v1/messages"]
VALID = {
    "/v1/chat/completions": {"model": "fake", "messages": USER, "max_tokens": 2},
    "/v1/completions": {"model": "fake", "prompt": "a b", "max_tokens": 2},
    "/v1/chunks": {"model": "fake", "documents": ["one two"]},
    "/v1/messages": {"model": "fake", "max_tokens": 2, "messages": USER},
}


def _error(r: httpx.Response, anthropic: bool) -> dict:
    body = r.json()
    if anthropic:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# --- F1 / F2 / F13: bad input --------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, param",
    [
        ([-1], "prompt[0]"),
        ([5, 49152], "prompt[1]"),
        ([1_000_000], "prompt[0]"),
        ([2**64], "prompt[0]"),
        ([2**70, 1], "prompt[0]"),
    ],
)
def test_out_of_range_token_ids_are_400_with_param(prompt, param):
    engine = FakeEngine()
    engine.vocab_size = 49152
    with make_client(engine) as c:
        r = c.post("/v1/completions", json={"model": "fake", "prompt": prompt}, headers=AUTH)
        assert r.status_code == 400, r.text
        err = _error(r, False)
        assert (
            err["param"] == param
            and err["code"] == "invalid_token_id"
            and "Overflow" not in err["message"]
        )
        assert (
            c.post(
                "/v1/completions",
                json={"model": "fake", "prompt": [5, 49151], "max_tokens": 1},
                headers=AUTH,
            ).status_code
            == 200
        )


@pytest.mark.parametrize("seed", [2**70, -(2**64)])
def test_seed_out_of_range_is_400_with_param(seed):
    with make_client() as c:
        r = c.post(
            "/v1/completions", json={"model": "fake", "prompt": "a", "seed": seed}, headers=AUTH
        )
        assert r.status_code == 400 and _error(r, False)["param"] == "seed", r.text


@pytest.mark.parametrize("path", POST_PATHS)
def test_deeply_nested_json_is_400_everywhere(path):
    deep = b'{"model":"fake","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with make_client() as c:
        r = c.post(path, content=deep, headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "nested too deeply" in _error(r, path == "/v1/messages")["message"]


@pytest.mark.parametrize("path", POST_PATHS)
def test_auth_comes_before_body_parsing_on_every_endpoint(path):
    anthropic = path == "/v1/messages"
    with make_client() as c:
        for body in (b"{", b"", b"[1]", json.dumps(VALID[path]).encode()):
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 401, (body, r.text)
            _error(r, anthropic)
        r = c.post(path, content=b"{", headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 400 and "could not parse" in _error(r, anthropic)["message"]
        r = c.post(path, content=b"", headers=AUTH)
        assert r.status_code == 400 and "body is empty" in _error(r, anthropic)["message"]
        assert "None" not in r.text
        r = c.post(path, json=VALID[path], headers=AUTH)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", POST_PATHS)
def test_unpaired_surrogate_escapes_are_400_and_pairs_pass(path):
    """JSON may carry half a UTF-16 pair ("\\ud800"); echoed or tokenized it was a 500 (found by the
    fuzz test of test_server.py on /v1/completions with echo)."""
    anthropic = path == "/v1/messages"
    text = json.dumps(VALID[path])
    with make_client() as c:
        for bad in ("\\ud800", "x\\udc00y"):
            body = (
                text.replace('"one two"', f'"{bad}"')
                .replace('"a b"', f'"{bad}"')
                .replace('"hello there"', f'"{bad}"')
            )
            r = c.post(
                path, content=body.encode(), headers={**AUTH, "content-type": "application/json"}
            )
            assert r.status_code == 400, (body, r.text)
            assert "surrogate" in _error(r, anthropic)["message"]
        body = text.replace('"hello there"', '"hi \\ud83d\\ude00"').replace(
            '"a b"', '"\\ud83d\\ude00"'
        )
        r = c.post(
            path, content=body.encode(), headers={**AUTH, "content-type": "application/json"}
        )
        assert r.status_code == 200, r.text


def test_chunks_without_model_when_several_are_served():
    models = [ModelEntry(id="fake"), ModelEntry(id="other")]
    with make_client(models=models) as c:
        r = c.post("/v1/chunks", json={"documents": ["a b"]}, headers=AUTH)
        assert r.status_code == 400, r.text
        err = _error(r, False)
        assert err["param"] == "model" and "None" not in err["message"] and "fake" in err["message"]


# --- F6: limits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", POST_PATHS)
def test_body_over_the_limit_is_413_before_it_is_read(path):
    with make_client(max_body_bytes=1000) as c:
        big = {**VALID[path], "documents": ["word " * 400]}
        r = c.post(path, json=big, headers=AUTH)
        assert r.status_code == 413, r.text
        assert "1000 bytes" in _error(r, path == "/v1/messages")["message"]
        assert c.post(path, json=VALID[path], headers=AUTH).status_code == 200


def test_too_many_documents_is_400():
    with make_client(max_documents=3) as c:
        docs = [f"doc {i}" for i in range(4)]
        for path, body in [
            ("/v1/chunks", {"model": "fake", "documents": docs}),
            ("/v1/chat/completions", {"model": "fake", "messages": USER, "documents": docs}),
            (
                "/v1/messages",
                {"model": "fake", "max_tokens": 2, "messages": USER, "documents": docs},
            ),
        ]:
            r = c.post(path, json=body, headers=AUTH)
            assert r.status_code == 400, r.text
            assert "at most 3" in _error(r, path == "/v1/messages")["message"]
        r = c.post("/v1/chunks", json={"model": "fake", "documents": docs[:3]}, headers=AUTH)
        assert r.status_code == 200 and len(r.json()["data"]) == 3


# --- F5 / F7 / F8: upstreams ----------------------------------------------------------------------


class LeakyUpstream:
    """An upstream that puts its caller's key everywhere it can, and one that
    ignores stream: true."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"data": []})
        body = json.loads(request.content)
        model = body["model"]
        long_msg = (
            "x" * 290 + f" key {UP_KEY} rejected"
        )  # the cut at 300 characters falls inside the key
        if model == "param":
            return httpx.Response(
                400, json={"error": {"message": long_msg, "param": UP_KEY, "code": UP_KEY[:20]}}
            )
        if model == "plain":
            return httpx.Response(500, content=(long_msg + " " + UP_KEY).encode())
        if model == "masked":  # how OpenAI shows a wrong key: a prefix and a suffix
            return httpx.Response(
                401,
                json={
                    "error": {
                        "message": f"Incorrect API key provided: {UP_KEY[:10]}****{UP_KEY[-4:]}x"
                    }
                },
            )
        if model == "json-only":  # ignores stream: true
            return httpx.Response(
                200,
                json={
                    "id": "c",
                    "object": "chat.completion",
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "plain json"},
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2},
                },
            )
        lines = [
            f": comment {UP_KEY}",
            f"event: {UP_KEY}",
            f"data: raw {UP_KEY}",
            "data: "
            + json.dumps(
                {
                    "model": model,
                    "choices": [{"index": 0, "delta": {"content": "hi"}}],
                    "note": UP_KEY,
                    UP_KEY: 1,
                }
            ),
            "data: "
            + json.dumps(
                {"error": {"message": long_msg, "code": UP_KEY, "param": UP_KEY, "type": UP_KEY}}
            ),
            "data: [DONE]",
        ]
        return httpx.Response(
            200,
            content="\n\n".join(lines).encode() + b"\n\n",
            headers={"content-type": "text/event-stream"},
        )


def make_gateway(monkeypatch, models: list[str]) -> TestClient:
    monkeypatch.setenv("KVBLEND_TEST_UP_KEY", UP_KEY)
    cfg = ServerConfig(
        models=[ModelEntry(id="fake")], api_keys=[ApiKey(KEY, "c")], default_max_tokens=4
    )
    backends = [LocalBackend(cfg.models[0], None, cfg, engine=FakeEngine())]
    for m in models:
        entry = ModelEntry(
            id=m,
            kind="upstream",
            base_url="http://up-host.example:9123/v1",
            upstream_model=m,
            api_key_env="KVBLEND_TEST_UP_KEY",
            retries=0,
        )
        backends.append(UpstreamBackend(entry, cfg, transport=httpx.MockTransport(LeakyUpstream())))
    return TestClient(create_app(cfg, backends=backends), raise_server_exceptions=False)


def _leaks(text: str) -> list[str]:
    """Every 6-character piece of the upstream key found in ``text``."""
    return sorted({UP_KEY[i : i + 6] for i in range(len(UP_KEY) - 5) if UP_KEY[i : i + 6] in text})


def test_no_byte_of_the_upstream_key_in_any_response(monkeypatch):
    models = ["param", "plain", "masked", "stream"]
    with make_gateway(monkeypatch, models) as c:
        bodies = []
        for m in models:
            for stream in (False, True):
                r = c.post(
                    "/v1/chat/completions",
                    json={"model": m, "messages": USER, "stream": stream},
                    headers=AUTH,
                )
                bodies.append(r.text)
                r = c.post(
                    "/v1/messages",
                    json={"model": m, "max_tokens": 4, "messages": USER, "stream": stream},
                    headers=AUTH,
                )
                bodies.append(r.text)
        assert all(not _leaks(b) for b in bodies), [
            (_leaks(b), b[:200]) for b in bodies if _leaks(b)
        ]
        assert any(
            "up-host" in b for b in bodies
        )  # errors still name the upstream's host (with a key)


def test_redactor_masks_before_cutting():
    from kvblend.server.upstream import Redactor

    r = Redactor(UP_KEY)
    assert r.text(f"a {UP_KEY} b") == "a *** b"
    assert r.text(f"prefix {UP_KEY[:12]}") == "prefix ***"
    assert r.obj({UP_KEY: [UP_KEY[5:20]], "n": 1}) == {"***": ["***"], "n": 1}
    assert r.text("ordinary text") == "ordinary text"


def test_upstream_ignoring_stream_true_still_answers_messages(monkeypatch):
    with make_gateway(monkeypatch, ["json-only"]) as c:
        body = {"model": "json-only", "max_tokens": 4, "messages": USER}
        r = c.post("/v1/messages", json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["content"] == [{"type": "text", "text": "plain json"}]
        assert r.json()["usage"]["output_tokens"] == 2
        with c.stream("POST", "/v1/messages", json={**body, "stream": True}, headers=AUTH) as s:
            text = "".join(s.iter_text())
        assert '"text":"plain json"' in text and "message_stop" in text


def test_health_hides_upstream_addresses_without_a_key(monkeypatch):
    with make_gateway(monkeypatch, ["stream"]) as c:
        r = c.get("/health")
        assert r.status_code == 200
        up = r.json()["upstreams"]["stream"]
        assert up["reachable"] is True and "up-host" not in r.text and "9123" not in r.text
        assert set(up) <= {"reachable", "status", "latency_ms"}
        assert (
            "up-host.example:9123" in c.get("/health", headers=AUTH).text
        )  # operators with a key see it


# --- F6: deferred chunk work in slices ------------------------------------------------------------


class DeferringEngine(FakeEngine):
    """Every prefill leaves six missing chunks to compute later (as blend requests with
    new documents do); each call computes two of them and records its time budget and whether a
    stream was decoding."""

    def __init__(self):
        super().__init__()
        self.left, self.calls = 0, []
        self.decoding = 0

    @property
    def has_deferred(self) -> bool:
        return self.left > 0

    def run_deferred(self, budget_s=None) -> int:
        n = min(2, self.left)
        self.calls.append((budget_s, self.decoding))
        self.left -= n
        return n

    def start(self, req):
        seq = super().start(req)
        self.left += 6
        self.decoding += not seq.finished
        return seq

    def step(self, seqs):
        self.decoding = len(seqs)
        events = super().step(seqs)
        self.decoding = sum(not s.finished for s in seqs)
        return events


def test_deferred_chunks_are_computed_in_time_slices_while_a_stream_decodes():
    """Deferred chunk work never runs unbounded: while a stream decodes each call gets a share
    of the last decoding step's time, when idle a short slice; all of it gets done."""
    import threading

    from kvblend.blend.segmenter import Segments
    from kvblend.engine.request import GenerationRequest, GenerationResult, SamplingParams
    from kvblend.engine.scheduler import DEFERRED_SHARE, IDLE_SLICE_S, Scheduler

    engine = DeferringEngine()
    engine.step_delay = 0.02
    sched = Scheduler(engine).start()
    try:
        done = threading.Event()
        sched.submit(
            GenerationRequest(Segments([1], [], [2]), SamplingParams(max_tokens=20)),
            lambda ev: done.set() if isinstance(ev, GenerationResult) else None,
        )
        assert done.wait(10)
        deadline = time.monotonic() + 10
        while engine.left and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.left == 0 and len(engine.calls) == 3, engine.calls
        assert all(budget is not None for budget, _ in engine.calls), engine.calls
        during = [budget for budget, decoding in engine.calls if decoding]
        # the first call follows the prefill, before any step: its budget is one layer's
        assert during and all(b <= DEFERRED_SHARE * 0.2 for b in during), engine.calls
        assert any(b >= DEFERRED_SHARE * 0.02 for b in during), engine.calls
        idle = [budget for budget, decoding in engine.calls if not decoding]
        assert all(b == IDLE_SLICE_S for b in idle), engine.calls
    finally:
        sched.stop()
