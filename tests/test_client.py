"""kvblend.client: auth.json profiles, the streaming helper and ``kvblend doctor``, against
the stand-in server."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from pathlib import Path

import pytest
from openai_standin import STANDIN_KEY, isolated, server  # noqa: F401 (pytest fixtures)

from kvblend.client import doctor
from kvblend.client.auth import AuthError, Endpoint, load_endpoint, mask_key
from kvblend.client.stream import (
    ChatRequest,
    make_async_client,
    parse_mode_list,
    parse_mode_spec,
    policy_extra_body,
    stream_chat,
)
from kvblend.policy import Mode, PrefillPolicy, Selection

KEY = STANDIN_KEY


pytestmark = pytest.mark.usefixtures("isolated")


def write_auth(path: Path, **settings) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings))
    return path


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_doctor(auth: Path, profile: str | None = None) -> int:
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    argv = ["--auth", str(auth), "--timeout", "10"] + (["--profile", profile] if profile else [])
    return doctor.run(parser.parse_args(argv))


# --- auth.json ------------------------------------------------------------------------------------


def test_mask_key_hides_the_key():
    assert mask_key(KEY) == "sk-...abcd"
    assert mask_key("") == "(none)"
    assert mask_key("short") == "***"
    assert "whitespace" in mask_key(KEY + "\n")
    assert KEY not in repr(Endpoint("x", "http://h/v1", api_key=KEY))


def test_lookup_order_and_xdg(tmp_path):
    xdg = write_auth(
        tmp_path / "xdg" / "kvblend" / "auth.json", base_url="http://xdg/v1", model_id="m"
    )
    assert load_endpoint().base_url == "http://xdg/v1"
    assert load_endpoint().source == str(xdg)
    write_auth(tmp_path / "auth.json", base_url="http://cwd/v1", model_id="m")
    assert load_endpoint().base_url == "http://cwd/v1"
    explicit = write_auth(
        tmp_path / "other" / "prod.json", base_url="http://explicit/v1/", model_id="m"
    )
    ep = load_endpoint(explicit)
    assert ep.base_url == "http://explicit/v1" and ep.name == "prod"


def test_profiles_inherit_and_env_overrides(tmp_path, monkeypatch):
    path = write_auth(
        tmp_path / "auth.json",
        base_url="http://a/v1",
        api_key=KEY,
        model_id="m1",
        timeout=5,
        profiles={"b": {"base_url": "http://b/v1"}, "c": {"model_id": "m3", "max_retries": 0}},
    )
    b = load_endpoint(path, "b")
    assert (b.base_url, b.api_key, b.model_id, b.timeout, b.name) == (
        "http://b/v1",
        KEY,
        "m1",
        5.0,
        "b",
    )
    assert load_endpoint(path, "c").max_retries == 0
    monkeypatch.setenv("KVBLEND_MODEL_ID", "from-env")
    monkeypatch.setenv("KVBLEND_BASE_URL", "http://env/v1")
    ep = load_endpoint(path, "b")
    assert (ep.base_url, ep.model_id) == ("http://env/v1", "from-env")
    assert "KVBLEND_BASE_URL" in ep.source


def test_environment_alone_is_enough(monkeypatch):
    monkeypatch.setenv("KVBLEND_BASE_URL", "http://env/v1")
    assert load_endpoint().base_url == "http://env/v1"


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "invalid JSON at line 1"),
        ('{"base_url": "http://a/v1", "apikey": "x"}', "unknown key(s) apikey"),
        ('{"base_url": "http://a/v1", "timeout": -1}', "timeout must be a positive number"),
        ('{"api_key": "x"}', "has no base_url"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_invalid_files_give_one_line_errors(tmp_path, content, message):
    path = tmp_path / "auth.json"
    path.write_text(content)
    with pytest.raises(AuthError) as err:
        load_endpoint(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_file_and_profile(tmp_path):
    with pytest.raises(AuthError, match="auth file not found"):
        load_endpoint(tmp_path / "nope.json")
    with pytest.raises(AuthError, match="no auth.json found"):
        load_endpoint()
    path = write_auth(tmp_path / "auth.json", base_url="http://a/v1", profiles={"x": {}, "y": {}})
    with pytest.raises(AuthError, match=r"profiles: x, y"):
        load_endpoint(path, "z")


# --- streaming helper -----------------------------------------------------------------------------


def test_mode_specs():
    assert parse_mode_spec("blend@0.15") == PrefillPolicy(Mode.BLEND, 0.15)
    assert parse_mode_spec("blend@0.1/lookahead:8") == PrefillPolicy(
        Mode.BLEND, 0.1, Selection.LOOKAHEAD, 8
    )
    assert policy_extra_body(parse_mode_spec("blend@0.15")) == {
        "mode": "blend",
        "recompute_ratio": 0.15,
    }
    assert policy_extra_body(parse_mode_spec("default")) == {}
    spec = parse_mode_spec("blend@0.15/lookahead")
    assert spec.label == "blend@0.15/lookahead" and policy_extra_body(spec) == {
        "mode": "blend",
        "recompute_ratio": 0.15,
        "selection": "lookahead",
    }
    assert policy_extra_body(parse_mode_spec("blend/query")) == {
        "mode": "blend",
        "selection": "query",
    }
    spec = parse_mode_spec(
        "blend@0.15/lookahead:8"
    )  # the reuse pass's first 8 layers, as bench engine says it
    assert (
        spec.label == "blend@0.15/lookahead:8"
        and policy_extra_body(spec)["selection"] == "lookahead:8"
    )
    with pytest.raises(ValueError, match="only lookahead takes a layer count"):
        parse_mode_spec("blend@0.15/query:8")
    assert [m.label for m in parse_mode_list("full, reuse,blend@0.5")] == [
        "full",
        "reuse",
        "blend@0.5",
    ]
    assert policy_extra_body(PrefillPolicy()) == {} and PrefillPolicy.parse("default").is_default
    with pytest.raises(ValueError, match="unknown prefill mode"):
        parse_mode_spec("turbo")
    with pytest.raises(ValueError, match="only blend takes a ratio"):
        parse_mode_spec("full@0.5")
    with pytest.raises(ValueError, match="within"):
        parse_mode_spec("blend@2")
    with pytest.raises(ValueError, match="unknown token selection 'best'"):
        parse_mode_spec("blend@0.15/best")
    with pytest.raises(ValueError, match="only blend takes a ratio or a token selection"):
        parse_mode_spec("reuse/query")


def test_stream_chat_reads_content_usage_and_passes_extra_body(server):
    ep = Endpoint("s", server.base_url, api_key=KEY, model_id="standin-a")
    doc = "A passage long enough to count as a document chunk."
    messages = [{"role": "user", "content": f"Instruction.\n\n{doc}\n\nQuestion: where?"}]

    async def go():
        client = make_async_client(ep)
        try:
            first = await stream_chat(
                client,
                "standin-a",
                ChatRequest(
                    messages, 8, extra_body=policy_extra_body(PrefillPolicy.parse("blend@0.25"))
                ),
            )
            again = await stream_chat(client, "standin-a", ChatRequest(messages, 8))
            missing = await stream_chat(client, "no-such-model", ChatRequest(messages, 8))
            return first, again, missing
        finally:
            await client.close()

    first, again, missing = asyncio.run(go())
    assert (
        first.ok
        and first.text == "Paris"
        and first.ttft_s is not None
        and first.ttft_s <= first.total_s
    )
    assert (
        first.empty_choice_chunks >= 1
    )  # the stand-in's mid-stream `choices: []` chunk was skipped
    assert first.prompt_tokens > 0 and first.cached_tokens == 0
    assert again.cached_tokens > 0  # the passages were seen by the first request
    assert missing.status_code == 404 and "does not exist" in missing.error
    body = server.requests()[-2]
    assert body["mode"] == "blend" and body["recompute_ratio"] == 0.25
    assert body["stream_options"] == {"include_usage": True}


# --- doctor ---------------------------------------------------------------------------------------


def test_doctor_all_pass(server, tmp_path, capsys):
    auth = write_auth(
        tmp_path / "auth.json", base_url=server.base_url, api_key=KEY, model_id="standin-a"
    )
    assert run_doctor(auth) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 6 and "FAIL" not in out
    assert "one-token TTFT" in out and " ms to first token" in out
    assert KEY not in out and "sk-...abcd" in out


def test_doctor_wrong_key(server, tmp_path, capsys):
    auth = write_auth(
        tmp_path / "auth.json",
        base_url=server.base_url,
        api_key="sk-wrong-000000000000",
        model_id="standin-a",
    )
    assert run_doctor(auth) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "key accepted" in ln)
    assert line.startswith("FAIL") and "401" in line and "wrong key" in line and "Bearer" in line


@pytest.mark.parametrize(
    "bad_key, expected", [(f" {KEY}\n", "stray whitespace"), (f"Bearer {KEY}", "'Bearer '")]
)
def test_doctor_key_format_mistakes_are_confirmed(server, tmp_path, capsys, bad_key, expected):
    auth = write_auth(
        tmp_path / "auth.json", base_url=server.base_url, api_key=bad_key, model_id="standin-a"
    )
    assert run_doctor(auth) == 1
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "key accepted" in ln)
    assert expected in line and "confirmed" in line
    assert KEY not in out


def test_doctor_closed_port(tmp_path, capsys):
    auth = write_auth(
        tmp_path / "auth.json",
        base_url=f"http://127.0.0.1:{free_port()}/v1",
        api_key=KEY,
        model_id="m",
    )
    assert run_doctor(auth) == 1
    lines = capsys.readouterr().out.splitlines()
    reach = next(ln for ln in lines if "endpoint reachable" in ln)
    assert reach.startswith("FAIL") and "network failure" in reach and "connection refused" in reach
    assert sum(ln.startswith("SKIP") for ln in lines) == 5


def test_doctor_unknown_model_lists_ids(server, tmp_path, capsys):
    auth = write_auth(
        tmp_path / "auth.json", base_url=server.base_url, api_key=KEY, model_id="gpt-9"
    )
    assert run_doctor(auth) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "model id exists" in ln)
    assert line.startswith("FAIL") and "'gpt-9'" in line and "standin-a, standin-b" in line


def test_doctor_missing_v1(server, tmp_path, capsys):
    auth = write_auth(
        tmp_path / "auth.json", base_url=server.root_url, api_key=KEY, model_id="standin-a"
    )
    assert run_doctor(auth) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "/v1 path" in ln)
    assert line.startswith("FAIL") and "404" in line and f"use {server.root_url}/v1" in line


def test_doctor_profile_selects_endpoint(server, tmp_path, capsys):
    auth = write_auth(
        tmp_path / "auth.json",
        base_url=f"http://127.0.0.1:{free_port()}/v1",
        api_key=KEY,
        model_id="standin-b",
        profiles={"standin": {"base_url": server.base_url}},
    )
    assert run_doctor(auth, "standin") == 0
    assert "endpoint standin:" in capsys.readouterr().out
