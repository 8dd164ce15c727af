"""Server pieces without a model: a stand-in engine behind the real scheduler, app,
config loader and auth."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient
from helpers import FakeEngine

from kvblend.blend.segmenter import Segments
from kvblend.config import ModelEntry, ServerConfig
from kvblend.engine.request import GenerationResult
from kvblend.engine.scheduler import Failed, QueueFullError, Scheduler, Started
from kvblend.server.app import create_app
from kvblend.server.auth import Authenticator
from kvblend.server.backends import LocalBackend
from kvblend.server.errors import APIError
from kvblend.settings import load_server_config, server_config_from_dict


def make_client(engine: FakeEngine, **config) -> TestClient:
    cfg = ServerConfig(models=[ModelEntry(id="fake")], **config)
    app = create_app(cfg, backends=[LocalBackend(cfg.models[0], None, cfg, engine=engine)])
    return TestClient(app, raise_server_exceptions=False)


USER = [{"role": "user", "content": "hello there"}]


def test_chat_and_stream_shapes():
    with make_client(FakeEngine()) as c:
        r = c.post(
            "/v1/chat/completions", json={"model": "fake", "messages": USER, "max_tokens": 3}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == "t0 t1 t2 "
        assert body["usage"]["completion_tokens"] == 3 and body["usage"][
            "prompt_tokens_details"
        ] == {"cached_tokens": 0}
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": "fake",
                "messages": USER,
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as s:
            lines = [ln for ln in s.iter_lines() if ln]
        assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
        assert '"usage":{"prompt_tokens"' in lines[-2] and '"choices":[]' in lines[-2]
        r = c.post(
            "/v1/completions",
            json={"model": "fake", "prompt": "a b", "max_tokens": 2, "echo": True},
        )
        assert r.json()["choices"][0]["text"] == "a bt0 t1 "


def test_engine_crash_is_500_without_details_and_server_survives():
    engine = FakeEngine(fail=True)
    with make_client(engine) as c:
        r = c.post("/v1/chat/completions", json={"model": "fake", "messages": USER})
        assert (
            r.status_code == 500
            and "secret" not in r.text
            and r.json()["error"]["type"] == "server_error"
        )
        engine.fail = False
        assert (
            c.post(
                "/v1/chat/completions", json={"model": "fake", "messages": USER, "max_tokens": 1}
            ).status_code
            == 200
        )


def test_queue_full_is_429_with_retry_after():
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    with make_client(engine, max_queue=1, max_batch=1, retry_after_s=3) as c:
        results: list[int] = []
        body = {"model": "fake", "messages": USER, "max_tokens": 1}
        first = threading.Thread(
            target=lambda: results.append(c.post("/v1/chat/completions", json=body).status_code)
        )
        first.start()
        assert engine.in_start.wait(10)  # first is in prefill (off the queue)
        second = threading.Thread(
            target=lambda: results.append(c.post("/v1/chat/completions", json=body).status_code)
        )
        second.start()
        backend = c.app.state.kvblend.by_id["fake"]
        deadline = time.monotonic() + 10
        while backend.queue_depth() < 1:  # second is waiting in the queue
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        gate.set()
        first.join(10), second.join(10)
        assert results == [200, 200]


def test_error_bodies():
    with make_client(FakeEngine()) as c:
        for r, status in [
            (
                c.post(
                    "/v1/chat/completions",
                    content=b"{",
                    headers={"content-type": "application/json"},
                ),
                400,
            ),
            (c.post("/v1/chat/completions", json={"model": "fake", "messages": USER, "n": 3}), 400),
            (c.post("/v1/chat/completions", json={"model": "x", "messages": USER}), 404),
            (c.get("/nope"), 404),
            (c.get("/v1/chat/completions"), 405),
            (
                c.post(
                    "/v1/chat/completions",
                    json={"model": "fake", "messages": USER, "max_tokens": 100},
                ),
                400,
            ),
        ]:
            assert r.status_code == status, r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_scheduler_batches_and_cancels():
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    engine.step_delay = 0.002  # request 3 would need minutes: it can only end by cancellation
    sched = Scheduler(engine, max_queue=8, max_batch=8).start()
    try:
        from kvblend.engine.request import GenerationRequest, SamplingParams

        def req(n):
            return GenerationRequest(Segments([1], [], [2]), SamplingParams(max_tokens=n))

        events: dict[int, list] = {i: [] for i in range(4)}
        handles = [sched.submit(req(100_000 if i == 3 else 5), events[i].append) for i in range(4)]
        gate.set()
        deadline = time.monotonic() + 10
        while not all(any(isinstance(e, GenerationResult) for e in events[i]) for i in range(3)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        handles[3].cancel()
        while sched.active_count:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert max(engine.batch_sizes) == 4  # all four decoded together
        assert isinstance(events[0][0], Started) and [e.text for e in events[0][1:-1]] == [
            f"t{i} " for i in range(5)
        ]
        assert not any(
            isinstance(e, (GenerationResult, Failed)) for e in events[3]
        )  # cancelled: dropped silently
        with pytest.raises(QueueFullError):
            gate.clear()
            for _ in range(10):
                sched.submit(req(1), lambda e: None)
        gate.set()
    finally:
        gate.set()
        sched.stop()


def test_config_yaml_and_toml(tmp_path, monkeypatch):
    yaml_text = """
host: 0.0.0.0
port: 9000
api_keys:
  - {key: sk-a, namespace: team-a}
  - sk-b
store: {tiers: [memory]}
models:
  - {id: small, model: "", mode: reuse, recompute_ratio: 0.3}
  - {id: big, kind: upstream, base_url: "https://example.invalid/v1", api_key_env: UPSTREAM_KEY}
"""
    toml_text = """
host = "0.0.0.0"
port = 9000
api_keys = [{key = "sk-a", namespace = "team-a"}, "sk-b"]
[store]
tiers = ["memory"]
[[models]]
id = "small"
model = ""
mode = "reuse"
recompute_ratio = 0.3
[[models]]
id = "big"
kind = "upstream"
base_url = "https://example.invalid/v1"
api_key_env = "UPSTREAM_KEY"
"""
    monkeypatch.delenv("KVBLEND_API_KEYS", raising=False)
    monkeypatch.delenv("KVBLEND_API_KEY", raising=False)
    (tmp_path / "s.yaml").write_text(yaml_text)
    (tmp_path / "s.toml").write_text(toml_text)
    a, b = load_server_config(tmp_path / "s.yaml"), load_server_config(tmp_path / "s.toml")
    assert a == b and a.port == 9000 and a.models[0].engine_config().blend.mode == "reuse"
    assert a.api_keys[0].namespace == "team-a" and a.models[1].kind == "upstream"
    monkeypatch.setenv("KVBLEND_API_KEYS", "sk-env:team-env")
    assert load_server_config(tmp_path / "s.yaml").api_keys[-1].namespace == "team-env"
    with pytest.raises(ValueError, match="unknown key"):
        server_config_from_dict({"models": [{"id": "x", "weights": "/tmp"}]})


def test_auth():
    from kvblend.config import ApiKey

    auth = Authenticator([ApiKey("sk-1", "one", "ns1"), ApiKey("sk-2", "two", "ns2")])
    assert auth.authenticate("Bearer sk-2").namespace == "ns2"
    for header in (None, "", "Basic sk-1", "Bearer sk-3", "Bearer sk-1x"):
        with pytest.raises(APIError) as e:
            auth.authenticate(header)
        assert e.value.status == 401
    assert Authenticator([]).authenticate(None).namespace == ""


def test_every_engine_setting_is_per_model():
    from kvblend.config import create_model_entry

    model = {
        "id": "m",
        "model": "",
        "dtype": "float32",
        "attention_kernel": "torch",
        "pipeline_loads": False,
        "calibration": "/tmp/cal.json",
        "mode": "reuse",
        "selection": "query",
        "blend": {"check_layers": [1, 4], "check_ratios": [0.3, 0.15], "mode": "full"},
    }
    cfg = server_config_from_dict({"models": [model, "/w/x.gguf"]})
    entry = cfg.models[0]
    engine = entry.engine_config()
    assert engine.model.attention_kernel == "torch" and not engine.pipeline_loads
    assert str(engine.calibration_path) == "/tmp/cal.json"
    assert (engine.blend.mode, engine.blend.selection) == ("reuse", "query")  # flat keys win
    assert engine.blend.check_layers == (1, 4) and engine.blend.check_ratios == (0.3, 0.15)
    assert cfg.models[1].model == "/w/x.gguf" and cfg.models[1].engine.blend.mode == "blend"
    assert create_model_entry(**entry.settings()) == entry
    with pytest.raises(ValueError, match=r"models\[0\]: unknown key\(s\) \['nope'\]"):
        server_config_from_dict({"models": [{"id": "m", "nope": 1}]})
