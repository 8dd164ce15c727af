"""Issue 33, scale-out: two `kvblend serve` replicas sharing one real redis-server,
behind a kvblend gateway.

A document ingested through replica A is a chunk hit on replica B, and killing A mid-stream leaves
B's stream (and later requests) untouched while A's stream ends with an error event."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

MODEL = "smollm2-135m-instruct"
UP_KEY, FRONT_KEY, ENV_KEY = "sk-replica-key", "sk-front-key", "KVBLEND_TEST_REPLICA_KEY"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
DOCS = [
    "The Varnholt ferry crosses the Lume estuary four times a day and was built in 1911.",
    "Captain Ilse Marrow commanded the Varnholt ferry for thirty years until 1962.",
    "The Lume estuary freezes in hard winters, when the ferry is replaced by a sledge road.",
]


def _replica(factory, redis_url: str):
    return factory(
        {
            "api_keys": [{"key": UP_KEY, "name": "gateway", "namespace": "fleet"}],
            "store": {
                "tiers": ["memory", "redis"],
                "redis_url": redis_url,
                "redis_socket_timeout_s": 2.0,
            },
            "models": [{"id": MODEL, "model": "", "num_threads": 1}],
            "default_max_tokens": 8,
        }
    )


def _gateway(factory, a, b):
    def up(gid, server):
        return {
            "id": gid,
            "kind": "upstream",
            "base_url": server.base_url + "/v1",
            "upstream_model": MODEL,
            "api_key_env": ENV_KEY,
            "timeout_s": 120,
            "retries": 0,
        }

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_KEY, UP_KEY)
        return factory(
            {"api_keys": [{"key": FRONT_KEY, "name": "client"}], "models": [up("a", a), up("b", b)]}
        )


def _stream(url: str, body: dict, out: dict) -> None:
    out["events"] = []
    try:
        with httpx.stream(
            "POST", url, json=body, timeout=300, headers={"Authorization": f"Bearer {FRONT_KEY}"}
        ) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data:"):
                    out["events"].append(line)
    except httpx.HTTPError as e:
        out["error"] = repr(e)


@pytest.mark.slow
def test_two_replicas_share_redis_behind_the_gateway(kvblend_server_factory, redis_server):
    import redis

    a = _replica(kvblend_server_factory, redis_server.url)
    b = _replica(kvblend_server_factory, redis_server.url)
    front = _gateway(kvblend_server_factory, a, b)
    oai = httpx.Client(
        base_url=front.base_url + "/v1",
        headers={"Authorization": f"Bearer {FRONT_KEY}"},
        timeout=300,
    )

    r = httpx.post(
        a.base_url + "/v1/chunks",
        json={"documents": DOCS},
        timeout=300,
        headers={"Authorization": f"Bearer {UP_KEY}"},
    )
    assert r.status_code == 200 and not any(d["cached"] for d in r.json()["data"]), r.text
    keys = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 30
    while len(keys.keys("kvblend:*")) < len(DOCS):  # replica A's background writer reaches redis
        assert time.monotonic() < deadline, "replica A never wrote its chunks to redis"
        time.sleep(0.1)

    r = oai.post(
        "/chat/completions",
        json={
            "model": "b",
            "max_tokens": 4,
            "documents": DOCS,
            "messages": [{"role": "user", "content": "Who commanded the ferry?"}],
        },
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["kvblend"]["chunks_hit"] == len(DOCS), usage
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0

    body = {"prompt": COUNTING, "max_tokens": 120, "temperature": 0, "stream": True}
    on_a, on_b = {}, {}
    threads = [
        threading.Thread(
            target=_stream, args=(front.base_url + "/v1/completions", {**body, "model": m}, out)
        )
        for m, out in (("a", on_a), ("b", on_b))
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while (
        len(on_a.get("events", [])) < 3 or len(on_b.get("events", [])) < 3
    ):  # both streams under way
        assert time.monotonic() < deadline, (on_a, on_b)
        time.sleep(0.05)
    a.proc.kill()  # replica A dies mid-stream
    for t in threads:
        t.join(300)
    assert on_b.get("status") == 200 and "error" not in on_b, on_b
    assert on_b["events"][-1] == "data: [DONE]" and not any('"error"' in e for e in on_b["events"])
    assert json.loads(on_b["events"][-2][5:])["choices"][0]["finish_reason"] == "length"
    assert any('"error"' in e for e in on_a["events"]) or "error" in on_a, on_a["events"][-2:]
    r = oai.post(
        "/chat/completions",
        json={
            "model": "b",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "Still there?"}],
        },
    )
    assert r.status_code == 200, r.text
    r = oai.post(
        "/chat/completions",
        json={
            "model": "a",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "Still there?"}],
        },
    )
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable", r.text
