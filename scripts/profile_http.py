"""Where the time between a client and the engine goes, request by request (paired).

    .venv/bin/python scripts/profile_http.py [--passages 10] [--requests 8] [--example 0]
        [--dtype auto] [--json FILE]

Serves the embedded model in this process (the app ``kvblend serve`` builds, under uvicorn), sends
streamed chat requests from a client subprocess (so the client does not share this process's GIL):
the MuSiQue passages of one example, shuffled per request, as blank-line text (bench ttft's prompt).
Each request's parts come from wrappers around the server's own calls, stamped with the monotonic
clock both processes share:

    client send -> app entry (HTTP parse) -> handler (body validated) -> worker picks the job up
    (queue) -> build_request (chat template, tokenization, segmentation) -> engine.start (engine's
    TTFT) -> first content SSE chunk formatted -> client reads it

and prints client TTFT against the engine's, with the gap split into those parts (medians; the first
request, which computes every chunk, is left out).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvblend.config import apply_malloc_defaults, apply_openmp_defaults  # noqa: E402

apply_openmp_defaults()
apply_malloc_defaults()

from kvblend.bench.data import DEFAULT_INSTRUCTION, build_prompt, load_musique  # noqa: E402

CLIENT = r"""
import json, sys, time, httpx
url, bodies = sys.argv[1], json.loads(sys.stdin.read())
out = []
with httpx.Client(timeout=600) as c:
    for body in bodies:
        t0 = time.perf_counter(); first = None; usage = None
        with c.stream("POST", url, json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                if first is None and ev["choices"] and ev["choices"][0]["delta"].get("content"):
                    first = time.perf_counter()
                if ev.get("usage"):
                    usage = ev["usage"]
        out.append({"send": t0, "first": first, "usage": usage})
print(json.dumps(out))
"""


def instrument(marks: list[dict]) -> None:
    """Wrap the server's calls; each request's timestamps go into the last dict of ``marks``."""
    import kvblend.server.app as app_mod
    import kvblend.server.backends as backends
    from kvblend.engine.engine import Engine

    def stamp(name: str) -> None:
        if marks and name not in marks[-1]:
            marks[-1][name] = time.perf_counter()

    mw_call = app_mod._RequestMetricsMiddleware.__call__

    async def middleware(self, scope, receive, send):
        if scope.get("path") == "/v1/chat/completions":
            marks.append({"app": time.perf_counter()})
        return await mw_call(self, scope, receive, send)

    app_mod._RequestMetricsMiddleware.__call__ = middleware
    chat_job = app_mod._chat_job  # called once the body is validated

    def stamped_chat_job(*args, **kw):
        stamp("handler")
        return chat_job(*args, **kw)

    app_mod._chat_job = stamped_chat_job
    build = backends.build_request

    def build_request(engine, job, default_max):
        stamp("dequeued")
        req = build(engine, job, default_max)
        stamp("built")
        return req

    backends.build_request = build_request
    start = Engine.start

    def engine_start(self, request):
        seq = start(self, request)
        stamp("prefilled")
        return seq

    Engine.start = engine_start
    chunk = app_mod._ChatFormat.chunk

    def chat_chunk(self, delta, *a, **kw):
        if delta.get("content"):
            stamp("sse")
        return chunk(self, delta, *a, **kw)

    app_mod._ChatFormat.chunk = chat_chunk


def serve(port: int, dtype: str):
    import uvicorn

    from kvblend.config import ServerConfig, create_model_entry
    from kvblend.server.app import create_app

    config = ServerConfig(port=port, models=[create_model_entry(dtype=dtype)], default_max_tokens=4)
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not come up")


def bodies(args) -> list[dict]:
    ex = load_musique()[args.example]
    rng = random.Random(0)
    out = []
    for _ in range(args.requests):
        passages = ex.passages[: args.passages]
        rng.shuffle(passages)
        out.append(
            {
                "model": "smollm2-135m-instruct",
                "max_tokens": 4,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [
                    {
                        "role": "user",
                        "content": build_prompt(DEFAULT_INSTRUCTION, passages, ex.question),
                    }
                ],
            }
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--passages", type=int, default=10)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--example", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--json", type=Path, help="write every request's parts here")
    args = p.parse_args()
    marks: list[dict] = []
    instrument(marks)
    server = serve(args.port, args.dtype)
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    run = subprocess.run(
        [sys.executable, "-c", CLIENT, url],
        input=json.dumps(bodies(args)),
        capture_output=True,
        text=True,
        check=True,
    )
    server.should_exit = True
    rows = []
    for client, m in zip(json.loads(run.stdout), marks):
        kv = client["usage"]["kvblend"]
        rows.append(
            {
                "prompt_tokens": client["usage"]["prompt_tokens"],
                "chunks_hit": kv["chunks_hit"],
                "client_ttft_ms": (client["first"] - client["send"]) * 1e3,
                "engine_ttft_ms": kv["ttft_ms"],
                "send_to_app": (m["app"] - client["send"]) * 1e3,
                "app_to_handler": (m["handler"] - m["app"]) * 1e3,
                "queue": (m["dequeued"] - m["handler"]) * 1e3,
                "build_request": (m["built"] - m["dequeued"]) * 1e3,
                "engine_start": (m["prefilled"] - m["built"]) * 1e3,
                "to_sse_chunk": (m["sse"] - m["prefilled"]) * 1e3,
                "sse_to_client": (client["first"] - m["sse"]) * 1e3,
            }
        )
    warm = rows[1:] or rows
    print(f"{len(warm)} warm requests, {warm[0]['prompt_tokens']} prompt tokens, medians in ms:")
    for key in [k for k in rows[0] if k not in ("prompt_tokens", "chunks_hit")]:
        print(f"  {key:16s} {statistics.median(r[key] for r in warm):9.1f}")
    gap = [r["client_ttft_ms"] / r["engine_ttft_ms"] for r in warm]
    print(f"  client / engine TTFT, paired median ratio: {statistics.median(gap):.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
