"""Gateway pieces without a model: upstream forwarding against an httpx.MockTransport stand-in, and
the Anthropic /v1/messages adapter over the stand-in engine of test_server_unit."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers import FakeEngine

from kvblend.config import ApiKey, ModelEntry, ServerConfig
from kvblend.server.app import create_app
from kvblend.server.backends import LocalBackend
from kvblend.server.upstream import UpstreamBackend
from kvblend.settings import server_config_from_dict

UP_KEY = "sk-upstream-secret-123456"
CLIENT_KEY = "sk-client-key"
USER = [{"role": "user", "content": "hello there"}]


class FakeUpstream:
    """An OpenAI-compatible service: model "ok" answers; "m401" / "m404" / "m429" /
    "timeout" fail so."""

    def __init__(self):
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.method == "GET":
            return httpx.Response(
                200, json={"object": "list", "data": [{"id": "ok", "object": "model"}]}
            )
        body = json.loads(request.content)
        model = body["model"]
        if model == "timeout":
            raise httpx.ReadTimeout("slow", request=request)
        if model == "m401":
            return httpx.Response(
                401,
                json={
                    "error": {
                        "message": f"Incorrect API key provided: {UP_KEY}",
                        "type": "invalid_request_error",
                        "code": "invalid_api_key",
                    }
                },
            )
        if model == "m404":
            return httpx.Response(
                404, json={"error": {"message": "no such model", "code": "model_not_found"}}
            )
        if model == "m429":
            return httpx.Response(
                429, json={"error": {"message": "slow down"}}, headers={"Retry-After": "7"}
            )
        if model == "m400":
            return httpx.Response(
                400,
                json={
                    "error": {
                        "message": "too long",
                        "param": "messages",
                        "code": "context_length_exceeded",
                    }
                },
            )
        usage = {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 3},
        }
        if not body.get("stream"):
            return httpx.Response(
                200,
                json={
                    "id": "c1",
                    "object": "chat.completion",
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "hi you"},
                        }
                    ],
                    "usage": usage,
                    "extra_field": 1,
                },
            )
        chunks = [
            {"id": "c1", "model": model, "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
            {"id": "c1", "model": model, "choices": [{"index": 0, "delta": {"content": "hi"}}]},
            {
                "id": "c1",
                "model": model,
                "choices": [{"index": 0, "delta": {"content": " you"}, "finish_reason": "stop"}],
            },
            {"id": "c1", "model": model, "choices": [], "usage": usage},
        ]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(
            200, content=sse.encode(), headers={"content-type": "text/event-stream"}
        )


def make_gateway(monkeypatch, upstream: FakeUpstream, **entries) -> TestClient:
    monkeypatch.setenv("KVBLEND_TEST_UP_KEY", UP_KEY)
    cfg = ServerConfig(
        models=[ModelEntry(id="local")],
        api_keys=[ApiKey(key=CLIENT_KEY, name="c")],
        default_max_tokens=4,
    )
    backends = [LocalBackend(cfg.models[0], None, cfg, engine=FakeEngine())]
    transport = httpx.MockTransport(upstream)
    for gid, upstream_model in {"remote": "ok", **entries}.items():
        entry = ModelEntry(
            id=gid,
            kind="upstream",
            base_url="http://up.example:9000/v1",
            upstream_model=upstream_model,
            api_key_env="KVBLEND_TEST_UP_KEY",
            retries=1,
        )
        backends.append(UpstreamBackend(entry, cfg, transport=transport))
    return TestClient(
        create_app(cfg, backends=backends),
        raise_server_exceptions=False,
        headers={"Authorization": f"Bearer {CLIENT_KEY}"},
    )


def test_config_upstream_entry_and_secret_rules():
    cfg = server_config_from_dict(
        {
            "models": [
                {"id": "local"},
                {
                    "id": "gpt",
                    "kind": "upstream",
                    "base_url": "https://api.example.com/v1",
                    "api_key_env": "OPENAI_KEY",
                    "timeout_s": 30,
                    "retries": 1,
                    "upstream_model": "gpt-4o-mini",
                },
            ]
        }
    )
    up = cfg.models[1]
    assert (up.kind, up.timeout_s, up.retries, up.upstream_model) == (
        "upstream",
        30,
        1,
        "gpt-4o-mini",
    )
    with pytest.raises(ValueError, match="api_key_env"):
        server_config_from_dict(
            {
                "models": [
                    {
                        "id": "gpt",
                        "kind": "upstream",
                        "base_url": "http://x/v1",
                        "api_key": "sk-oops",
                    }
                ]
            }
        )
    with pytest.raises(ValueError, match="base_url"):
        ModelEntry(id="gpt", kind="upstream", base_url="api.example.com")
    backend = UpstreamBackend(
        ModelEntry(id="gpt", kind="upstream", base_url="http://x/v1", api_key_env="NOPE_UNSET")
    )
    with pytest.raises(ValueError, match="NOPE_UNSET"):
        backend.start()


def test_forward_rewrites_model_and_key(monkeypatch):
    up = FakeUpstream()
    with make_gateway(monkeypatch, up) as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "remote",
                "messages": USER,
                "max_tokens": 3,
                "n": 1,
                "logit_bias": {"1": 2},
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "remote" and r.json()["extra_field"] == 1  # body relayed as is
        sent = json.loads(up.requests[-1].content)
        assert sent["model"] == "ok" and sent["logit_bias"] == {"1": 2}
        assert up.requests[-1].headers["authorization"] == f"Bearer {UP_KEY}"
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": "remote", "messages": USER, "stream": True},
        ) as s:
            lines = [ln for ln in s.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]" and len(lines) == 5
        objs = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert (
            all(o["model"] == "remote" for o in objs)
            and objs[-1]["usage"]["completion_tokens"] == 2
        )
        assert {m["id"] for m in c.get("/v1/models").json()["data"]} == {"local", "remote"}
        h = c.get("/health").json()
        assert h["status"] == "ok" and h["upstreams"]["remote"]["reachable"] is True
        assert UP_KEY not in json.dumps(h)
        m = c.get("/metrics").text
        assert (
            'kvblend_requests_total{endpoint="/v1/chat/completions",'
            'model_name="remote",status="200"} 2.0' in m
        )
        assert 'kvblend_ttft_seconds_count{model_name="remote"} 1.0' in m


@pytest.mark.parametrize(
    "model, status, code",
    [
        ("m401", 502, "upstream_auth_failed"),
        ("m404", 502, "upstream_model_not_found"),
        ("m429", 429, "upstream_rate_limited"),
        ("m400", 400, "context_length_exceeded"),
        ("timeout", 504, "upstream_timeout"),
    ],
)
def test_upstream_errors_are_mapped(monkeypatch, model, status, code):
    with make_gateway(monkeypatch, FakeUpstream(), bad=model) as c:
        for stream in (False, True):
            r = c.post(
                "/v1/chat/completions", json={"model": "bad", "messages": USER, "stream": stream}
            )
            err = r.json()["error"]
            assert r.status_code == status and err["code"] == code, r.text
            assert "upstream 'bad' (up.example:9000)" in err["message"] and UP_KEY not in r.text
        if status == 429:
            assert r.headers["retry-after"] == "7"
        r = c.post("/v1/messages", json={"model": "bad", "max_tokens": 4, "messages": USER})
        assert (
            r.status_code == status and r.json()["type"] == "error" and "upstream 'bad'" in r.text
        )


def test_unreachable_upstream_is_502_and_local_still_answers(monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServerConfig(models=[ModelEntry(id="local")])
    dead = UpstreamBackend(
        ModelEntry(id="dead", kind="upstream", base_url=f"http://127.0.0.1:{port}/v1", retries=1)
    )
    app = create_app(
        cfg, backends=[LocalBackend(cfg.models[0], None, cfg, engine=FakeEngine()), dead]
    )
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json={"model": "dead", "messages": USER})
        err = r.json()["error"]
        assert r.status_code == 502 and err["code"] == "upstream_unreachable", r.text
        assert (
            f"upstream 'dead' (127.0.0.1:{port}) is unreachable: connection "
            "refused after 2 attempts" in err["message"]
        )
        assert (
            c.post(
                "/v1/chat/completions", json={"model": "local", "messages": USER, "max_tokens": 1}
            ).status_code
            == 200
        )
        h = c.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "degraded"
        assert h.json()["upstreams"]["dead"]["reachable"] is False


def _events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(ln.split(": ", 1) for ln in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_anthropic_messages_local(monkeypatch):
    with make_gateway(monkeypatch, FakeUpstream()) as c:
        h = {"x-api-key": CLIENT_KEY}
        body = {
            "model": "local",
            "max_tokens": 3,
            "system": "Be brief.",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "doc one"},
                        {"type": "text", "text": "question?"},
                    ],
                }
            ],
        }
        r = c.post("/v1/messages", json=body, headers=h)
        assert r.status_code == 200, r.text
        m = r.json()
        assert m["type"] == "message" and m["content"] == [{"type": "text", "text": "t0 t1 t2 "}]
        assert m["stop_reason"] == "max_tokens" and m["usage"]["output_tokens"] == 3
        assert {"input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"} <= set(
            m["usage"]
        )
        r = c.post("/v1/messages", json={**body, "stop_sequences": ["t1"]}, headers=h)
        assert r.json()["stop_reason"] == "stop_sequence" and r.json()["stop_sequence"] == "t1"
        assert r.json()["content"][0]["text"] == "t0 "
        r = c.post("/v1/messages", json={**body, "stream": True}, headers=h)
        ev = _events(r.text)
        names = [e for e, _ in ev]
        assert names[:3] == ["message_start", "content_block_start", "ping"] and names[-3:] == [
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        assert (
            "".join(d["delta"]["text"] for e, d in ev if e == "content_block_delta") == "t0 t1 t2 "
        )
        assert (
            ev[-2][1]["delta"]["stop_reason"] == "max_tokens"
            and ev[-2][1]["usage"]["output_tokens"] == 3
        )


def test_anthropic_messages_upstream_and_errors(monkeypatch):
    up = FakeUpstream()
    with make_gateway(monkeypatch, up) as c:
        h = {"x-api-key": CLIENT_KEY}
        r = c.post(
            "/v1/messages", json={"model": "remote", "max_tokens": 5, "messages": USER}, headers=h
        )
        m = r.json()
        assert (
            m["content"][0]["text"] == "hi you"
            and m["stop_reason"] == "end_turn"
            and m["model"] == "remote"
        )
        assert m["usage"]["cache_read_input_tokens"] == 3 and m["usage"]["input_tokens"] == 2
        sent = json.loads(up.requests[-1].content)
        assert sent["model"] == "ok" and sent["max_tokens"] == 5 and sent["stream"] is True
        r = c.post(
            "/v1/messages",
            json={"model": "remote", "max_tokens": 5, "messages": USER},
            headers={"x-api-key": "no"},
        )
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = c.post(
            "/v1/messages", json={"model": "nope", "max_tokens": 5, "messages": USER}, headers=h
        )
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = c.post("/v1/messages", json={"model": "local", "messages": USER}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in r.json()["error"]["message"]
        r = c.post("/v1/messages", content=b"{bad", headers=h)
        assert r.status_code == 400 and r.json()["type"] == "error"
