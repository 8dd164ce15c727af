"""Issue 33 F4: SIGTERM on a real `kvblend serve` (embedded model) while streams are live.

Live streams finish normally within the drain timeout, or end with an in-band error event after it;
a request arriving meanwhile gets 503 in the endpoint's own error shape; then the process exits."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

MODEL = "smollm2-135m-instruct"
COUNTING = (
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"  # a raw completion prompt the model keeps counting on
)


class Stream(threading.Thread):
    """One streamed request, read to its end; ``first`` is set at its first event."""

    def __init__(self, base_url: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = base_url + path, body
        self.first = threading.Event()
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.last_at = 0.0  # time.monotonic() of the last event

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data:") or line.startswith("event:"):
                        self.events.append(line)
                        self.last_at = time.monotonic()
                        self.first.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.first.set()


def _streams(base_url: str, max_tokens: int) -> list[Stream]:
    oai = {
        "model": MODEL,
        "prompt": COUNTING,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    claude = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [
            {"role": "user", "content": "Write a very long story about a lighthouse keeper."}
        ],
    }
    out = [Stream(base_url, "/v1/completions", oai) for _ in range(2)] + [
        Stream(base_url, "/v1/messages", claude)
    ]
    for s in out:
        s.start()
    for s in out:
        assert s.first.wait(120)
    return out


def _sigterm_and_check_503(server) -> float:
    server.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    time.sleep(0.3)
    r = httpx.post(
        server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
    )
    assert r.status_code == 503 and r.headers.get("retry-after"), r.text
    assert r.json()["error"]["code"] == "service_unavailable"
    r = httpx.post(
        server.base_url + "/v1/messages",
        json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 503 and r.json()["type"] == "error", r.text
    assert httpx.get(server.base_url + "/health").status_code == 503
    return t0


@pytest.mark.slow
def test_sigterm_lets_live_streams_finish_then_exits(kvblend_server_factory):
    server = kvblend_server_factory(
        {"models": [{"id": MODEL, "model": ""}], "drain_timeout_s": 120}
    )
    streams = _streams(server.base_url, 48)
    _sigterm_and_check_503(server)
    for s in streams:
        s.join(120)
        assert s.error is None, s.error
    oai, claude = streams[:2], streams[2]
    for s in oai:
        assert s.events[-1] == "data: [DONE]", s.events[-3:]
        assert json.loads(s.events[-2][5:])["choices"][0]["finish_reason"] in ("length", "stop")
    assert claude.events[-1] == 'data: {"type":"message_stop"}', claude.events[-3:]
    assert server.proc.wait(30) is not None  # exited on its own once drained


@pytest.mark.slow
def test_sigterm_ends_streams_past_the_drain_timeout_with_an_error_event(kvblend_server_factory):
    server = kvblend_server_factory({"models": [{"id": MODEL, "model": ""}], "drain_timeout_s": 1})
    streams = _streams(
        server.base_url, 3000
    )  # minutes of decoding: cannot finish within the timeout
    t0 = _sigterm_and_check_503(server)
    for s in streams:
        s.join(60)
        assert not s.is_alive() and s.error is None, s.error
    oai, claude = streams[:2], streams[2]
    for s in oai:
        err = json.loads(s.events[-1][5:])["error"]
        assert "shutting down" in err["message"] and err["code"] == "service_unavailable", s.events[
            -2:
        ]
    if (
        claude.events[-1] == 'data: {"type":"message_stop"}'
    ):  # the model ended its story within the drain
        assert claude.last_at < t0 + 1.5
    else:
        assert claude.events[-2] == "event: error" and "shutting down" in claude.events[-1], (
            claude.events[-2:]
        )
    assert server.proc.wait(30) is not None
    assert time.monotonic() - t0 < 30
