"""`kvblend serve` end to end: one real server subprocess (embedded model) per module,
the official client.

Every test uses its own document texts, so cache hits come only from what that test sent.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import time

import httpx
import openai
import pytest

MODEL = "smollm2-135m-instruct"
KEY_A, KEY_B = "sk-test-tenant-a", "sk-test-tenant-b"


@pytest.fixture(scope="module")
def server(kvblend_server_factory):
    config = {
        "api_keys": [
            {"key": KEY_A, "name": "a", "namespace": "tenant-a"},
            {"key": KEY_B, "name": "b", "namespace": "tenant-b"},
        ],
        "max_queue": 32,
        "max_batch": 8,
        "default_max_tokens": 8,
        "models": [{"id": MODEL, "model": ""}],
    }
    return kvblend_server_factory(config)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)


def docs(tag: str, n: int = 3) -> list[str]:
    facts = [
        "The lighthouse on {t} island was built in 1874 and painted red.",
        "The baker of {t} village sells rye bread every Tuesday morning.",
        "The {t} river floods each spring when the mountain snow melts.",
        "The {t} library keeps a map of the old harbour in its basement.",
    ]
    return [facts[i % len(facts)].format(t=f"{tag}{i}") for i in range(n)]


def chat(client, messages, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=kw.pop("max_tokens", 4), **kw
    )


def kv(resp) -> dict:
    return resp.usage.model_extra["kvblend"]


def test_health_and_models(server, client):
    assert httpx.get(server.base_url + "/health").json()["models"] == [MODEL]
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_health_and_usage_name_the_attention_kernel(server, client):
    """/health says which attention kernel each local model runs and, when it is not the CPU's best
    native build, why; every response's usage.kvblend says the same."""
    attention = httpx.get(server.base_url + "/health").json()["attention"][MODEL]
    assert attention["kernel"] in ("amx", "avx512bf16", "avx2", "torch")
    if attention["kernel"] == "torch":
        assert attention["reason"]  # e.g. "this CPU lacks avx2, fma (needed by the avx2 kernel)"
    r = chat(client, [{"role": "user", "content": "Say hi."}], max_tokens=1)
    assert (kv(r)["attention_kernel"], kv(r)["attention_kernel_reason"]) == (
        attention["kernel"],
        attention["reason"],
    )


def test_chat_non_stream(client):
    r = chat(
        client,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
    )
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in (
        "stop",
        "length",
    )
    u = r.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and 1 <= u.completion_tokens <= 4
    assert u.prompt_tokens_details.cached_tokens == kv(r)["cached_tokens"]
    assert {
        "reused_tokens",
        "recomputed_tokens",
        "fresh_tokens",
        "chunks_hit",
        "chunks_total",
        "mode",
        "recompute_ratio",
        "ttft_ms",
    } <= set(kv(r))


def test_chat_stream(client):
    stream = chat(
        client,
        [{"role": "user", "content": "Count to five."}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish and finish[-1] in ("stop", "length") and text
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_endpoint(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3)
    assert r.object == "text_completion" and r.usage.completion_tokens >= 1
    s = list(client.completions.create(model=MODEL, prompt="One, two,", max_tokens=3, stream=True))
    assert s and s[-1].choices[0].finish_reason in ("stop", "length")


def _chat_parts(ds, q):
    return {
        "messages": [{"role": "user", "content": [{"type": "text", "text": d} for d in ds + [q]]}]
    }


def _chat_documents(ds, q):
    return {"messages": [{"role": "user", "content": q}], "extra_body": {"documents": ds}}


def _chat_plain(ds, q):
    return {"messages": [{"role": "user", "content": "\n\n".join(ds + [q])}]}


@pytest.mark.parametrize(
    "build", [_chat_parts, _chat_documents, _chat_plain], ids=["parts", "documents", "plain"]
)
def test_shuffled_documents_hit_cache(client, build):
    ds = docs(build.__name__, 4)
    q = "Which of these facts mention water?"
    first = chat(client, **build(ds, q))
    shuffled = ds[1:] + ds[:1]
    random.Random(0).shuffle(shuffled)
    second = chat(client, **build(shuffled, q))
    # The template prefix may already be cached from earlier tests; the documents must not be.
    assert kv(first)["chunks_hit"] == 0 and kv(first)["chunks_total"] == 4, kv(first)
    assert kv(second)["chunks_hit"] == 4, kv(second)
    assert (
        second.usage.prompt_tokens_details.cached_tokens
        > first.usage.prompt_tokens_details.cached_tokens
    )


def test_mode_and_ratio_overrides(client):
    ds = docs("override")
    chat(client, **_chat_documents(ds, "Any?"))
    r = chat(
        client,
        messages=[{"role": "user", "content": "Any?"}],
        extra_body={"documents": ds, "mode": "reuse"},
    )
    assert kv(r)["mode"] == "reuse" and kv(r)["recomputed_tokens"] == 0
    r = chat(
        client,
        messages=[{"role": "user", "content": "Any?"}],
        extra_body={"documents": ds, "mode": "blend", "recompute_ratio": 0.5},
    )
    assert (
        kv(r)["mode"] == "blend"
        and kv(r)["recompute_ratio"] == 0.5
        and kv(r)["selection"] == "lookahead"  # auto keeps the Llama family's selection
    )
    r = chat(
        client,
        messages=[{"role": "user", "content": "Any?"}],
        extra_body={"documents": ds, "mode": "blend", "recompute_ratio": 0.5, "selection": "query"},
    )
    assert kv(r)["selection"] == "query" and kv(r)["recomputed_tokens"] > 0
    r = chat(
        client,
        messages=[{"role": "user", "content": "Any?"}],  # lookahead over its first 2 layers
        extra_body={
            "documents": ds,
            "mode": "blend",
            "recompute_ratio": 0.5,
            "selection": "lookahead:2",
        },
    )
    assert kv(r)["selection"] == "lookahead:2" and kv(r)["recomputed_tokens"] > 0


def test_tenants_do_not_share_chunks(server, client):
    ds = docs("tenant")
    chat(client, **_chat_documents(ds, "Q?"))
    other = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY_B, max_retries=0)
    r = chat(other, **_chat_documents(ds, "Q?"))
    assert kv(r)["chunks_hit"] == 0, kv(r)


def test_chunks_endpoint_precomputes(server, client):
    ds = docs("ingest")
    body = {"model": MODEL, "documents": [ds[0], {"id": "mine", "text": ds[1]}, ds[2]]}
    r = httpx.post(
        server.base_url + "/v1/chunks",
        json=body,
        headers={"Authorization": f"Bearer {KEY_A}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert (
        [d["cached"] for d in data] == [False] * 3
        and data[1]["id"] == "mine"
        and data[0]["num_tokens"] > 0
    )
    hit = chat(client, **_chat_documents(ds[::-1], "Which is about bread?"))
    assert kv(hit)["chunks_hit"] == 3 and hit.usage.prompt_tokens_details.cached_tokens > 0


def _error(exc_info) -> dict:
    return exc_info.value.body


def test_auth_errors(server):
    for key in ("wrong-key", ""):
        c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            chat(c, [{"role": "user", "content": "hi"}])
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(
            model="gpt-nope", messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.code == "model_not_found" and MODEL in e.value.message


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": 5}, "temperature"),
        ({"n": 2}, "n"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"extra_body": {"mode": "turbo"}}, "mode"),
        ({"extra_body": {"recompute_ratio": 2}}, "recompute_ratio"),
        ({"extra_body": {"selection": "best"}}, "selection"),
        ({"extra_body": {"selection": "lookahead:x"}}, "selection"),
    ],
)
def test_bad_params_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], **kwargs
        )
    assert e.value.param == param and e.value.type == "invalid_request_error"


def test_malformed_bodies_400(server):
    h = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    url = server.base_url + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers=h)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, json={"model": MODEL}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(
        url, json={"model": MODEL, "messages": [{"role": "assistant", "content": "hi"}]}, headers=h
    )
    assert r.status_code == 400 and "user" in r.json()["error"]["message"]


def test_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, [{"role": "user", "content": "hi"}], max_tokens=10_000_000)
    assert e.value.code == "context_length_exceeded" and "maximum context length" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, [{"role": "user", "content": "word " * 9000}])
    assert e.value.code == "context_length_exceeded"
    assert re.search(
        r"maximum context length is \d+ tokens.*resulted in \d+ tokens", e.value.message
    )


def test_eight_concurrent_clients(server):
    def one(i: int) -> str:
        c = openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=120
        )
        stream = i % 2 == 0
        r = chat(
            c,
            [{"role": "user", "content": f"Give me word number {i}."}],
            max_tokens=6,
            stream=stream,
        )
        if stream:
            return "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices)
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))  # raises on any error
    assert len(results) == 8 and all(isinstance(t, str) for t in results)


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_move(server, client):
    before = httpx.get(server.base_url + "/metrics").text
    chat(client, **_chat_documents(docs("metrics"), "Q?"))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    after = httpx.get(server.base_url + "/metrics").text
    ok = dict(endpoint="/v1/chat/completions", status="200", model_name=MODEL)
    assert _metric(after, "kvblend_requests_total", **ok) > _metric(
        before, "kvblend_requests_total", **ok
    )
    assert _metric(after, "kvblend_requests_total", status="404") > _metric(
        before, "kvblend_requests_total", status="404"
    )
    assert _metric(after, "kvblend_ttft_seconds_count") > _metric(
        before, "kvblend_ttft_seconds_count"
    )
    assert _metric(after, "kvblend_prompt_tokens_total", kind="fresh") > _metric(
        before, "kvblend_prompt_tokens_total", kind="fresh"
    )
    assert "kvblend_queue_depth{" in after and "kvblend_store_" in after and 'tier="' in after


def test_disconnect_cancels_generation(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "max_tokens": 4000,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        server.base_url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY_A}"},
        timeout=30,
    ) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # got a token: hang up mid-generation
    deadline = (
        time.monotonic() + 20
    )  # 4000 tokens would take minutes; cancellation takes a decode step
    while True:
        active = _metric(
            httpx.get(server.base_url + "/metrics").text,
            "kvblend_active_sequences",
            model_name=MODEL,
        )
        if active == 0:
            break
        assert time.monotonic() < deadline, "generation kept running after the client disconnected"
        time.sleep(0.05)


def test_openapi_fuzz_no_500(server):
    """Bounded schemathesis run over the served OpenAPI spec: no input may produce a 5xx."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    headers = {"Authorization": f"Bearer {KEY_A}"}
    deadline = time.monotonic() + 60
    failures: list[str] = []
    calls = 0
    operations = [r.ok() for r in schema.get_all_operations()]
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    for op, mode in [(op, mode) for op in operations for mode in modes]:

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(
            max_examples=8,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def check(case):
            if time.monotonic() > deadline:
                return
            if isinstance(case.body, dict):
                if random.random() < 0.5:
                    case.body["model"] = MODEL  # reach the engine, not only validation and 404s
                case.body["max_tokens"] = 2
                case.body.pop("max_completion_tokens", None)
            nonlocal calls
            calls += 1
            resp = case.call(base_url=server.base_url, headers=headers, timeout=60)
            if resp.status_code >= 500:
                failures.append(
                    f"{op.label}: {resp.status_code} {resp.text[:200]} for {case.body!r}"[:500]
                )

        try:
            check()
        except Unsatisfiable:  # negative mode on an operation without inputs (GET /health)
            pass
    assert not failures, failures[:5]
    assert calls >= len(operations) * 4, calls
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_ingest_cli_via_url(server, client, tmp_path, capsys):
    from kvblend.cli import main

    ds = docs("cli-ingest")
    f = tmp_path / "docs.jsonl"
    f.write_text("\n".join(json.dumps({"id": f"d{i}", "text": d}) for i, d in enumerate(ds)) + "\n")
    out = tmp_path / "out.jsonl"
    assert (
        main(["ingest", str(f), "--url", server.base_url, "--api-key", KEY_A, "--output", str(out)])
        == 0
    )
    assert "3 computed" in capsys.readouterr().out
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["d0", "d1", "d2"]
    r = chat(client, **_chat_documents(ds[::-1], "Which one floods?"))
    assert kv(r)["chunks_hit"] == 3
