"""One gateway for every model, end to end: two real `kvblend serve` processes (embedded model).

The *upstream* server serves the model with its own key. The *front* server (the gateway)
serves a local copy of the model plus two upstream entries pointing at the upstream server:
one with the right key (given to the front through an environment variable), one with a wrong
key. Clients: the official openai and anthropic SDKs, and `kvblend doctor`. The test that
stops the upstream runs last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

MODEL = "smollm2-135m-instruct"
LOCAL, REMOTE, BADKEY = "local-smol", "remote-smol", "remote-badkey"
FRONT_KEY, UP_KEY, WRONG_UP_KEY = (
    "sk-gateway-client",
    "sk-upstream-only-key",
    "sk-wrong-upstream-key",
)
ENV_KEY, ENV_BAD = "KVBLEND_TEST_UPSTREAM_KEY", "KVBLEND_TEST_UPSTREAM_BADKEY"


@pytest.fixture(scope="module")
def servers(kvblend_server_factory):
    upstream = kvblend_server_factory(
        {
            "api_keys": [{"key": UP_KEY, "name": "gateway"}],
            "default_max_tokens": 8,
            "models": [{"id": MODEL, "model": "", "num_threads": 1}],
        }
    )

    def remote(gid: str, env: str) -> dict:
        return {
            "id": gid,
            "kind": "upstream",
            "base_url": upstream.base_url + "/v1",
            "upstream_model": MODEL,
            "api_key_env": env,
            "timeout_s": 60,
            "retries": 1,
        }

    with (
        pytest.MonkeyPatch.context() as mp
    ):  # the front server's environment, read once at its start
        mp.setenv(ENV_KEY, UP_KEY)
        mp.setenv(ENV_BAD, WRONG_UP_KEY)
        front = kvblend_server_factory(
            {
                "api_keys": [{"key": FRONT_KEY, "name": "client"}],
                "default_max_tokens": 8,
                "models": [
                    {"id": LOCAL, "model": "", "num_threads": 1},
                    remote(REMOTE, ENV_KEY),
                    remote(BADKEY, ENV_BAD),
                ],
            }
        )
    return front, upstream


@pytest.fixture(scope="module")
def front(servers):
    return servers[0]


@pytest.fixture(scope="module")
def oai(front) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=front.base_url + "/v1", api_key=FRONT_KEY, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def claude(front) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=front.base_url, api_key=FRONT_KEY, max_retries=0, timeout=120
    )


USER = [{"role": "user", "content": "Say hello."}]


def test_models_and_health(front, oai):
    assert {m.id for m in oai.models.list().data} == {LOCAL, REMOTE, BADKEY}
    h = httpx.get(
        front.base_url + "/health", timeout=10, headers={"Authorization": f"Bearer {FRONT_KEY}"}
    ).json()  # details need a key
    assert h["status"] == "ok" and h["upstreams"][REMOTE]["reachable"] is True
    assert h["upstreams"][REMOTE]["auth_ok"] is True and h["upstreams"][BADKEY]["auth_ok"] is False
    assert UP_KEY not in json.dumps(h) and WRONG_UP_KEY not in json.dumps(h)


@pytest.mark.parametrize("model", [LOCAL, REMOTE])
def test_openai_client_reaches_both(oai, model):
    r = oai.chat.completions.create(model=model, messages=USER, max_tokens=3)
    assert r.model == model and r.choices[0].message.content and 1 <= r.usage.completion_tokens <= 3
    chunks = list(
        oai.chat.completions.create(
            model=model,
            messages=USER,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.model == model for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    c = oai.completions.create(model=model, prompt="One, two,", max_tokens=2)
    assert c.model == model and c.choices[0].text is not None


def test_wrong_upstream_key_names_the_upstream(oai):
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model=BADKEY, messages=USER, max_tokens=2)
    assert e.value.status_code == 502 and e.value.code == "upstream_auth_failed"
    msg = e.value.message
    assert f"upstream '{BADKEY}'" in msg and ENV_BAD in msg and "401" in msg
    assert WRONG_UP_KEY not in msg and UP_KEY not in msg and FRONT_KEY not in msg


def _doc_blocks(tag: str, question: str) -> list[dict]:
    docs = [
        f"The lighthouse on {tag} island was built in 1874 and painted red.",
        f"The baker of {tag} village sells rye bread every Tuesday morning.",
        f"The {tag} river floods each spring when the mountain snow melts.",
    ]
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": d} for d in docs]
            + [{"type": "text", "text": question}],
        }
    ]


@pytest.mark.parametrize("model", [LOCAL, REMOTE])
def test_anthropic_client(claude, model):
    m = claude.messages.create(model=model, max_tokens=4, system="Be brief.", messages=USER)
    assert (
        m.type == "message"
        and m.model == model
        and m.content[0].type == "text"
        and m.content[0].text
    )
    assert m.stop_reason in ("end_turn", "max_tokens") and 1 <= m.usage.output_tokens <= 4
    with claude.messages.stream(model=model, max_tokens=4, messages=USER) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.content[0].text == text and final.usage.output_tokens >= 1
    assert final.stop_reason in ("end_turn", "max_tokens")
    # The same documents as separate text blocks, twice: the second reads them from the chunk cache.
    msgs = _doc_blocks(f"anthropic-{model}", "Which place has bread?")
    first = claude.messages.create(model=model, max_tokens=2, messages=msgs)
    second = claude.messages.create(model=model, max_tokens=2, messages=msgs)
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    assert second.usage.input_tokens < first.usage.input_tokens


def test_anthropic_errors(front, claude):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(
            base_url=front.base_url, api_key="wrong", max_retries=0
        ).messages.create(model=LOCAL, max_tokens=2, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=2, messages=USER)


def test_doctor_through_gateway(front, tmp_path):
    auth = tmp_path / "auth.json"
    auth.write_text(
        json.dumps({"base_url": front.base_url + "/v1", "api_key": FRONT_KEY, "model_id": REMOTE})
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("KVBLEND_BASE_URL", "KVBLEND_API_KEY", "KVBLEND_CLIENT", "KVBLEND_MODEL_ID")
        )
    }
    p = subprocess.run(
        [sys.executable, "-m", "kvblend.cli", "doctor", "--auth", str(auth)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "checks passed" in p.stdout and "FAIL" not in p.stdout


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_per_model(front):
    m = httpx.get(front.base_url + "/metrics", timeout=10).text
    for model in (LOCAL, REMOTE):
        assert (
            _metric(
                m,
                "kvblend_requests_total",
                model_name=model,
                endpoint="/v1/chat/completions",
                status="200",
            )
            > 0
        )
        assert (
            _metric(
                m, "kvblend_requests_total", model_name=model, endpoint="/v1/messages", status="200"
            )
            > 0
        )
        assert _metric(m, "kvblend_ttft_seconds_count", model_name=model) > 0
    assert _metric(m, "kvblend_requests_total", model_name=BADKEY, status="502") > 0


def test_stopped_upstream_is_502_while_local_answers(servers, oai, claude):
    front, upstream = servers
    upstream.stop()
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model=REMOTE, messages=USER, max_tokens=2)
    assert e.value.status_code == 502 and e.value.code == "upstream_unreachable"
    assert f"upstream '{REMOTE}' (127.0.0.1:{upstream.port})" in e.value.message
    with pytest.raises(openai.APIStatusError) as e:
        list(oai.chat.completions.create(model=REMOTE, messages=USER, max_tokens=2, stream=True))
    assert e.value.status_code == 502
    with pytest.raises(anthropic.APIStatusError) as e:
        claude.messages.create(model=REMOTE, max_tokens=2, messages=USER)
    assert e.value.status_code == 502 and f"upstream '{REMOTE}'" in e.value.message
    r = oai.chat.completions.create(model=LOCAL, messages=USER, max_tokens=2)
    assert r.choices[0].message.content is not None
    deadline = time.monotonic() + 10  # /health caches each probe for a couple of seconds
    while True:
        h = httpx.get(front.base_url + "/health", timeout=10)
        if h.json()["status"] == "degraded" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert h.status_code == 200 and h.json()["status"] == "degraded"
    assert h.json()["upstreams"][REMOTE]["reachable"] is False
