"""A tiny OpenAI-compatible chat server (stdlib only) standing in for "any
endpoint" in client tests.

Run as a process: ``python tests/openai_standin.py --key sk-test --models m1,m2`` prints
``PORT <n>`` once listening on 127.0.0.1 (``--port 0`` picks a free one). ``StandinServer``
starts it from a test.

What it speaks, deliberately like real servers:
- ``GET /health`` (no auth), ``GET /v1/models``, ``POST /v1/chat/completions`` (stream and not);
  any other path is a 404 in OpenAI's error shape, so a base_url without ``/v1``
  fails like it would.
- 401 unless ``Authorization: Bearer <key>`` matches exactly (when a key is configured).
- 404 ``model_not_found`` for an unknown model id.
- Streams start with a role-only delta and include one chunk with ``choices: []`` before the
  content, which clients must tolerate; usage (with ``prompt_tokens_details.cached_tokens``) comes
  last when ``stream_options.include_usage`` is set.
- A simulated chunk cache: the user message is split at blank lines and pieces seen before count as
  cached tokens (a token = a whitespace word), unless the request asks for mode "full".
- The answer is ``--answer`` (default "Paris"), except in mode "reuse" where it is "London Bridge",
  so tests can see the per-request override change quality.
- ``GET /debug/requests`` returns the received chat request bodies (for
  asserting extra_body fields).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx


class StandinState:
    def __init__(
        self, key: str, models: list[str], answer: str, usage: bool, delay_per_token_s: float
    ):
        self.key = key
        self.models = models
        self.answer = answer
        self.usage = usage
        self.delay_per_token_s = delay_per_token_s
        self.seen_pieces: set[str] = set()
        self.requests: list[dict] = []
        self.lock = threading.Lock()


def _pieces(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p]


def _words(text: str) -> int:
    return len(text.split())


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # close-delimited bodies: simplest correct streaming
    state: StandinState  # set on the subclass made in serve()

    def log_message(self, fmt, *args):  # keep test output quiet
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        self._json(
            status, {"error": {"message": message, "type": type_, "param": None, "code": code}}
        )

    def _authorized(self) -> bool:
        if not self.state.key:
            return True
        header = self.headers.get("Authorization")
        if header is None or not header.startswith("Bearer "):
            self._error(
                401, "Missing bearer token in the Authorization header", "invalid_request_error"
            )
            return False
        if header != f"Bearer {self.state.key}":
            self._error(
                401, "Incorrect API key provided", "invalid_request_error", "invalid_api_key"
            )
            return False
        return True

    def do_GET(self):
        if self.path == "/health":
            return self._json(200, {"status": "ok"})
        if self.path == "/debug/requests":
            with self.state.lock:
                return self._json(200, {"requests": list(self.state.requests)})
        if self.path == "/v1/models":
            if not self._authorized():
                return
            data = [
                {"id": m, "object": "model", "created": 0, "owned_by": "standin"}
                for m in self.state.models
            ]
            return self._json(200, {"object": "list", "data": data})
        self._error(404, f"Not found: {self.path}", "not_found")

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if self.path != "/v1/chat/completions":
            return self._error(404, f"Not found: {self.path}", "not_found")
        if not self._authorized():
            return
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            return self._error(400, "invalid JSON body", "invalid_request_error")
        if body.get("model") not in self.state.models:
            return self._error(
                404,
                f"The model `{body.get('model')}` does not exist",
                "invalid_request_error",
                "model_not_found",
            )
        with self.state.lock:
            self.state.requests.append(body)
        self._complete(body)

    def _complete(self, body: dict) -> None:
        text = "\n\n".join(str(m.get("content", "")) for m in body.get("messages", []))
        mode = body.get("mode")
        pieces = _pieces(text)
        with self.state.lock:
            cached = 0
            if mode != "full":
                cached = sum(_words(p) for p in pieces[:-1] if p in self.state.seen_pieces)
            self.state.seen_pieces.update(pieces[:-1])
        prompt_tokens = _words(text)
        time.sleep(self.state.delay_per_token_s * (prompt_tokens - cached))  # "prefill"
        answer = "London Bridge" if mode == "reuse" else self.state.answer
        words = answer.split()[: max(1, int(body.get("max_tokens") or 16))]
        finish = "stop" if len(words) == len(answer.split()) else "length"
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(words),
            "total_tokens": prompt_tokens + len(words),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        cid, model, created = f"chatcmpl-{uuid.uuid4().hex[:12]}", body["model"], int(time.time())
        if not body.get("stream"):
            msg = {"role": "assistant", "content": " ".join(words)}
            return self._json(
                200,
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                    "usage": usage,
                },
            )
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def chunk(choices: list, **extra) -> None:
            obj = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        chunk([])  # an empty-choices chunk mid-stream: clients must not index choices[0] blindly
        for i, w in enumerate(words):
            chunk(
                [
                    {
                        "index": 0,
                        "delta": {"content": w if i == 0 else " " + w},
                        "finish_reason": None,
                    }
                ]
            )
        chunk([{"index": 0, "delta": {}, "finish_reason": finish}])
        if self.state.usage and (body.get("stream_options") or {}).get("include_usage"):
            chunk([], usage=usage)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def serve(port: int, state: StandinState) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    return server


class StandinServer:
    """Runs the stand-in in a subprocess; ``base_url`` is ready once the context is entered."""

    def __init__(
        self,
        key: str = "sk-standin-0123456789abcd",
        models: tuple[str, ...] = ("standin-a", "standin-b"),
        answer: str = "Paris",
        usage: bool = True,
        delay_per_token_s: float = 0.0,
    ):
        self.key, self.models = key, models
        self.args = [
            "--key",
            key,
            "--models",
            ",".join(models),
            "--answer",
            answer,
            "--delay-per-token",
            str(delay_per_token_s),
        ] + ([] if usage else ["--no-usage"])
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"

    def requests(self) -> list[dict]:
        return httpx.get(self.root_url + "/debug/requests", timeout=5).json()["requests"]

    def __enter__(self) -> "StandinServer":
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--port", "0", *self.args],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()  # "PORT n", printed once the socket is bound
        if not line.startswith("PORT "):
            self.__exit__()
            raise RuntimeError(f"stand-in server did not start: {line!r}")
        self.port = int(line.split()[1])
        deadline = time.monotonic() + 20
        while True:  # poll health rather than sleep a fixed time
            try:
                if httpx.get(self.root_url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("stand-in server never became healthy")
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--key", default="")
    p.add_argument("--models", default="standin-a")
    p.add_argument("--answer", default="Paris")
    p.add_argument(
        "--no-usage", action="store_true", help="never send usage (like llama.cpp's server)"
    )
    p.add_argument(
        "--delay-per-token",
        type=float,
        default=0.0,
        help="simulated prefill seconds per uncached token",
    )
    a = p.parse_args()
    state = StandinState(
        a.key, [m for m in a.models.split(",") if m], a.answer, not a.no_usage, a.delay_per_token
    )
    server = serve(a.port, state)
    print(f"PORT {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()


# ---- fixtures shared by the client / harness tests (import them into the test module) ------------
# fixtures only; the stand-in server itself needs nothing beyond the stdlib
import pytest  # noqa: E402

STANDIN_KEY = "sk-standin-0123456789abcd"


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No auth.json or KVBLEND_* variable from the developer's machine leaks into a test."""
    for var in (
        "KVBLEND_BASE_URL",
        "KVBLEND_API_KEY",
        "KVBLEND_CLIENT_API_KEY",
        "KVBLEND_MODEL_ID",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def server():
    with StandinServer(key=STANDIN_KEY) as s:
        yield s
