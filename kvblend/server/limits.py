"""The gate every API request passes before a route sees it, and the input limits routes share.

``GateMiddleware`` (pure ASGI, outermost) answers, in this order, for every path under ``/v1/``:

1. 503 while the server drains for shutdown (``Lifecycle.draining``), ``Retry-After`` set;
2. 401 without a valid key (auth first, as OpenAI and vLLM do: nothing about a request is looked
   at, not even whether its body parses, before the caller is known);
3. 413 for a body over ``max_body_bytes``: at once from ``Content-Length``, or as soon as a chunked
   body passes the limit, so an oversized body never reaches JSON parsing or the tokenizer;
4. 400 for a POST body that is empty, not JSON, nested too deeply to parse, or not a JSON object.

Errors are in the endpoint's own shape (Anthropic's for ``/v1/messages``, OpenAI's elsewhere). The
gate also counts requests in flight, which graceful shutdown waits on (``shutdown.py``).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from kvblend.server import errors

T = TypeVar("T")
ANTHROPIC_PATHS = ("/v1/messages",)
# vLLM's token endpoints sit outside /v1/ but take keys and bodies like the rest of the API.
TOKEN_PATHS = ("/tokenize", "/detokenize")


def is_api_path(path: str) -> bool:
    """Paths the gate checks (auth, body size, JSON) and /openapi.json documents as the API."""
    return path.startswith("/v1/") or path in TOKEN_PATHS


MAX_TOKEN_ID = 2**31 - 1  # beyond any vocabulary; keeps torch from overflowing on int64 conversion


@dataclass
class Lifecycle:
    """Shutdown state shared by the gate, /health and the drain loop."""

    draining: bool = False
    inflight: int = 0  # /v1/ requests whose response has not finished (streams included)


def install_gate(app, state) -> None:
    state.lifecycle = Lifecycle()
    app.add_middleware(GateMiddleware, state=state)


class GateMiddleware:
    def __init__(self, app, state):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not is_api_path(path):
            return await self.app(scope, receive, send)
        anthropic = path in ANTHROPIC_PATHS
        lifecycle: Lifecycle = self.state.lifecycle
        try:
            if lifecycle.draining:
                raise errors.unavailable(
                    "The server is shutting down and accepts no new "
                    "requests; retry on another replica.",
                    self.state.config.retry_after_s,
                )
            authenticate(self.state.auth, Request(scope), anthropic)
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                body = await _read_body(scope, receive, self.state.config.max_body_bytes)
                check_json_object(body)
                receive = _replay(body, receive)
        except errors.APIError as e:
            return await _respond(e, anthropic, scope, receive, send)
        lifecycle.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            lifecycle.inflight -= 1


def authenticate(auth, request: Request, anthropic: bool):
    """The caller's principal; Anthropic clients may send ``x-api-key`` instead of a bearer."""
    key = request.headers.get("x-api-key") if anthropic else None
    if key is not None and key.strip():
        return auth.authenticate(f"Bearer {key.strip()}")
    return auth.authenticate(request.headers.get("authorization"))


def has_valid_key(state, request: Request) -> bool:
    """True when auth is off or the request carries a valid key (either header)."""
    for anthropic in (False, True):
        try:
            authenticate(state.auth, request, anthropic)
            return True
        except errors.APIError:
            pass
    return False


def too_large(limit: int) -> errors.APIError:
    return errors.APIError(
        413,
        f"The request body exceeds this server's limit of {limit} bytes (max_body_bytes).",
        "invalid_request_error",
        None,
        "request_too_large",
    )


async def _read_body(scope, receive, limit: int) -> bytes:
    length = dict(scope.get("headers") or []).get(b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit)
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise errors.APIError(499, "client disconnected", code="client_closed_request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def check_json_object(body: bytes) -> None:
    """400 unless ``body`` is one JSON object; RecursionError (deep nesting) is bad input."""
    if not body.strip():
        raise errors.invalid_request(
            "The request body is empty; send a JSON object with the "
            "request's parameters (Content-Type: application/json).",
            None,
            "empty_body",
        )
    try:
        data = json.loads(body)
    except RecursionError:
        raise errors.invalid_request(
            "The JSON body is nested too deeply to parse.", None, "json_too_deep"
        ) from None
    except ValueError:
        raise errors.invalid_request(
            "We could not parse the JSON body of your request. (HINT: "
            "This likely means you aren't using your HTTP library "
            "correctly.)",
            None,
            "invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise errors.invalid_request(
            f"The request body must be a JSON object, not {type(data).__name__}.",
            None,
            "invalid_body",
        )
    if _SURROGATE_ESCAPE.search(body) and _has_lone_surrogate(data):
        # JSON may escape half a UTF-16 pair; no tokenizer or UTF-8 response can carry one
        raise errors.invalid_request(
            "The request contains invalid Unicode (an unpaired surrogate escape such as \\ud800).",
            None,
            "invalid_unicode",
        )


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(value) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later: the disconnect, which streaming responses watch for

    return replay


async def _respond(e: errors.APIError, anthropic: bool, scope, receive, send) -> None:
    if e.status == 499:
        return
    if anthropic:
        response = errors.anthropic_error_response(e)
    else:
        response = e.response()
    if e.status == 413:
        response.headers["Connection"] = "close"  # the rest of the body is never read
    await response(scope, receive, send)


# --- checks routes and backends share ------------------------------------------------------------


def check_token_ids(prompt, vocab_size: int | None, param: str = "prompt") -> None:
    """Token-id prompts: every id in [0, vocab_size), else 400 naming the first bad position."""
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], int):
        return
    limit = min(vocab_size or MAX_TOKEN_ID + 1, MAX_TOKEN_ID + 1)
    for i, t in enumerate(prompt):
        if not 0 <= t < limit:
            raise errors.invalid_request(
                f"Invalid token id {t} at {param}[{i}]: token ids must be "
                f"in [0, {limit - 1}] for this model.",
                f"{param}[{i}]",
                "invalid_token_id",
            )


def check_num_documents(num: int, limit: int, param: str = "documents") -> None:
    if num > limit:
        raise errors.invalid_request(
            f"Too many documents/chunks in one request: {num}; this "
            f"server accepts at most {limit} (max_documents). Split the "
            "request.",
            param,
            "too_many_documents",
        )


def check_chunk_sizes(chunk_ids: list[list[int]], max_tokens: int | None) -> None:
    """400 for a document whose KV no store tier could keep: it would be computed and dropped on
    every call (``cached: false`` forever) with nothing saying why."""
    if max_tokens is None:
        return
    for i, ids in enumerate(chunk_ids):
        if len(ids) > max_tokens:
            raise errors.invalid_request(
                f"documents[{i}] is {len(ids)} tokens; its KV would exceed every store tier's "
                f"budget (at most {max_tokens} tokens fit). Split it, or raise store.memory_bytes "
                "/ store.disk_bytes.",
                f"documents[{i}]",
                "chunk_too_large",
            )


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client hangs up first; then cancel it (and the
    generation with it)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise errors.APIError(499, "client disconnected", code="client_closed_request")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
