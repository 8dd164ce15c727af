"""The OpenAI-compatible HTTP app: ``create_app(config)`` builds everything; nothing lives in module globals.

Request flow: validate (pydantic) -> authenticate (bearer key -> namespace) -> resolve the model id to
a backend -> ``backend.open(job)`` (queues, waits for prefill: errors become proper 4xx before any
byte is sent) -> stream ``Delta`` events as SSE, or collect them into one JSON body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvblend.config import ServerConfig
from kvblend.server import errors
from kvblend.server.auth import Authenticator, Principal
from kvblend.server.backends import Backend, Delta, Final, GenerationJob, build_backends, build_store, document_id
from kvblend.server.anthropic import anthropic_router
from kvblend.server.metrics import Metrics
from kvblend.server.schemas import (
    ChatCompletionRequest, ChunkInfo, ChunksRequest, ChunksResponse, CompletionRequest, Document, ErrorResponse,
    Health, ModelCard, ModelList,
)
from kvblend.server.upstream import upstream_for, upstream_health

log = logging.getLogger(__name__)
T = TypeVar("T")

ERROR_RESPONSES: dict = {code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 500, 503)}
_KNOWN_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/chunks", "/v1/messages", "/health",
                    "/metrics"}


class ServerState:
    """Everything a request handler needs; one instance per app."""

    def __init__(self, config: ServerConfig, backends: list[Backend], store):
        self.config = config
        self.backends = backends
        self.store = store
        self.by_id: dict[str, Backend] = {}
        self.ready = False
        self.auth = Authenticator(config.api_keys)
        self.metrics = Metrics(self.queue_depths, self.store_stats)

    def queue_depths(self) -> dict[str, tuple[int, int]]:
        """{model: (waiting, active)} for the scrape-time gauges."""
        return {b.id: (b.queue_depth(), b.active()) for b in self.by_id.values()}

    def store_stats(self) -> dict:
        return self.store.stats() if self.store is not None and hasattr(self.store, "stats") else {}

    def resolve(self, model: str | None) -> Backend:
        if not self.ready:
            raise errors.unavailable("the server is still loading its models", self.config.retry_after_s)
        if model is None and len(self.by_id) == 1:
            return next(iter(self.by_id.values()))
        backend = self.by_id.get(model or "")
        if backend is None:
            raise errors.model_not_found(str(model), sorted(self.by_id))
        return backend


def create_app(config: ServerConfig, backends: list[Backend] | None = None, store=None) -> FastAPI:
    """Build the app. ``backends`` (tests) replaces the ones the config describes."""
    if backends is None:
        store = build_store(config.store) if store is None else store
        backends = build_backends(config, store)
    state = ServerState(config, backends, store)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        for b in state.backends:  # loading weights blocks: keep it off the event loop
            await asyncio.to_thread(b.start)
            state.by_id[b.id] = b
        if len(state.by_id) != len(state.backends):
            raise ValueError(f"duplicate model ids after loading: {[b.id for b in state.backends]}")
        state.ready = True
        log.info("serving models: %s", ", ".join(state.by_id))
        try:
            yield
        finally:
            state.ready = False
            for b in state.backends:
                b.close()

    app = FastAPI(title="kvblend", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server with CacheBlend chunk KV reuse.")
    app.state.kvblend = state
    errors.install_error_handlers(app)
    app.include_router(anthropic_router(state))  # POST /v1/messages (Anthropic-shaped errors of its own)
    app.add_middleware(_RequestMetricsMiddleware, metrics=state.metrics)
    auth = Depends(state.auth)

    @app.get("/health", response_model=Health, responses=ERROR_RESPONSES)
    async def health() -> Any:
        if not state.ready:
            raise errors.unavailable("loading models")
        upstreams = await upstream_health(state.by_id.values()) or None  # short timeout, cached briefly
        degraded = any(not u.get("reachable") for u in (upstreams or {}).values())
        engines = {i: getattr(b, "engine", None) for i, b in state.by_id.items()}  # local models only
        attention = {i: {"kernel": e.attention_kernel, "reason": getattr(e, "attention_kernel_reason", None)}
                     for i, e in engines.items() if hasattr(e, "attention_kernel")}
        return Health(status="degraded" if degraded else "ok", models=list(state.by_id), upstreams=upstreams,
                      attention=attention or None)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def list_models(_: Principal = auth) -> Any:
        return ModelList(data=[_card(b) for b in state.by_id.values()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def get_model(model_id: str, _: Principal = auth) -> Any:
        return _card(state.resolve(model_id))

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request, principal: Principal = auth) -> Any:
        if (upstream := upstream_for(state, body.model)) is not None:  # relayed as is (kvblend/server/upstream.py)
            return await upstream.forward(request, "/chat/completions", state.metrics)
        _check_common(body)
        backend = state.resolve(body.model)
        request.state.model = backend.id  # resolved ids only: metric labels stay bounded
        job = _chat_job(body, principal)
        job.max_tokens = body.max_completion_tokens or body.max_tokens
        return await _respond(request, state, backend, job, body.stream, _include_usage(body), _ChatFormat(backend.id))

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request, principal: Principal = auth) -> Any:
        if (upstream := upstream_for(state, body.model)) is not None:
            return await upstream.forward(request, "/completions", state.metrics)
        _check_common(body)
        if body.best_of is not None and body.best_of > 1:
            raise errors.invalid_request("best_of > 1 is not supported by this server.", "best_of")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise errors.invalid_request("Only one prompt per request is supported.", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise errors.invalid_request("prompt must not be empty.", "prompt")
        backend = state.resolve(body.model)
        request.state.model = backend.id
        job = _sampling_job(body, principal)
        job.prompt = prompt
        echo = prompt if body.echo and isinstance(prompt, str) else ""
        return await _respond(request, state, backend, job, body.stream, _include_usage(body),
                              _CompletionFormat(backend.id, echo))

    @app.post("/v1/chunks", response_model=ChunksResponse, responses=ERROR_RESPONSES)
    async def chunks(body: ChunksRequest, request: Request, principal: Principal = auth) -> Any:
        backend = state.resolve(body.model)
        request.state.model = backend.id
        docs = [_document(d) for d in body.documents]
        if any(not d.text for d in docs):
            raise errors.invalid_request("documents must have non-empty text.", "documents")
        infos = await _until_disconnect(request, backend.precompute([d.text for d in docs], principal.namespace))
        data = [ChunkInfo(id=d.id or document_id(d.text), num_tokens=int(i["num_tokens"]),
                          cached=bool(i.get("cached", False)), key=i.get("key")) for d, i in zip(docs, infos)]
        total = sum(c.num_tokens for c in data)
        return ChunksResponse(model=backend.id, data=data, usage={"prompt_tokens": total, "total_tokens": total})

    return app


# --- request -> job ------------------------------------------------------------------------------

def _check_common(body) -> None:
    if body.n is not None and body.n > 1:
        raise errors.invalid_request("n > 1 is not supported by this server; send n requests.", "n")


def _include_usage(body) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _document(d: str | Document) -> Document:
    return Document(text=d) if isinstance(d, str) else d


def _sampling_job(body, principal: Principal) -> GenerationJob:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4:
        raise errors.invalid_request("At most 4 stop sequences are supported.", "stop")
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if top_p == 0.0:  # OpenAI accepts 0: only the most likely token survives, i.e. greedy
        temperature, top_p = 0.0, 1.0
    return GenerationJob(
        documents=[_document(d).text for d in body.documents or []], max_tokens=body.max_tokens,
        temperature=temperature, top_p=top_p, stop=[s for s in stop if s], seed=body.seed, mode=body.mode,
        recompute_ratio=body.recompute_ratio, selection=body.selection, namespace=principal.namespace,
    )


def _chat_job(body: ChatCompletionRequest, principal: Principal) -> GenerationJob:
    messages: list[dict] = []
    for i, m in enumerate(body.messages):
        content: Any = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise errors.invalid_request(f"Only text content parts are supported (got {part.type!r}).",
                                                 f"messages[{i}].content[{j}]")
            content = [{"type": "text", "text": p.text} for p in content]
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    job = _sampling_job(body, principal)
    job.messages = messages
    return job


def _card(b: Backend) -> ModelCard:
    return ModelCard(id=b.id, created=b.created, owned_by=b.owned_by)


# --- responding ----------------------------------------------------------------------------------

async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client hangs up first; then cancel it (which cancels the generation)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise errors.APIError(499, "client disconnected", "invalid_request_error", None, "client_closed_request")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _respond(request: Request, state: ServerState, backend: Backend, job: GenerationJob, stream: bool | None,
                   include_usage: bool, fmt: "_ChatFormat | _CompletionFormat") -> Response:
    t0 = time.perf_counter()
    gen = await _until_disconnect(request, backend.open(job))
    if stream:
        return StreamingResponse(_sse(state, backend, gen, fmt, include_usage, t0), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect() -> Final:
        first = True
        async for ev in gen.events():
            if first:
                state.metrics.ttft.labels(backend.id).observe(time.perf_counter() - t0)
                first = False
            if isinstance(ev, Final):
                return ev
        raise errors.internal_error()

    final = await _until_disconnect(request, collect())
    state.metrics.observe_generation(backend.id, final.kvblend, final.completion_tokens)
    return JSONResponse(fmt.full(final))


async def _sse(state: ServerState, backend: Backend, gen, fmt, include_usage: bool, t0: float) -> AsyncIterator[str]:
    first = True
    try:
        opening = fmt.opening()
        if opening is not None:  # chat opens with the assistant role; completions only when echoing
            yield _data(fmt.chunk(opening, None, include_usage))
        async for ev in gen.events():
            if first:
                state.metrics.ttft.labels(backend.id).observe(time.perf_counter() - t0)
                first = False
            if isinstance(ev, Delta):
                yield _data(fmt.chunk(fmt.delta(ev.text), None, include_usage))
            else:
                state.metrics.observe_generation(backend.id, ev.kvblend, ev.completion_tokens)
                yield _data(fmt.chunk(fmt.closing(), ev.finish_reason, include_usage))
                if include_usage:
                    yield _data({**fmt.base(), "choices": [], "usage": _usage(ev)})
        yield "data: [DONE]\n\n"
    except errors.APIError as e:  # headers are gone: report in-band, as OpenAI does
        yield _data(e.body())
    except Exception:
        log.exception("stream failed")
        yield _data(errors.internal_error().body())
    finally:
        gen.cancel()  # client gone (GeneratorExit / CancelledError) or done: free the sequence


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _usage(f: Final) -> dict:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": f.cached_tokens}, "kvblend": f.kvblend}


class _ChatFormat:
    def __init__(self, model: str):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def base(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def opening(self) -> dict:
        return {"role": "assistant", "content": ""}

    def delta(self, text: str) -> dict:
        return {"content": text}

    def closing(self) -> dict:
        return {}

    def chunk(self, delta: dict, finish_reason: str | None, include_usage: bool) -> dict:
        out = {**self.base(), "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        if include_usage:
            out["usage"] = None
        return out

    def full(self, f: Final) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": f.text, "refusal": None},
                             "logprobs": None, "finish_reason": f.finish_reason}],
                "usage": _usage(f)}


class _CompletionFormat:
    def __init__(self, model: str, echo: str = ""):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.echo = echo

    def base(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def opening(self) -> str | None:
        return self.echo or None

    def delta(self, text: str) -> str:
        return text

    def closing(self) -> str:
        return ""

    def chunk(self, text: str, finish_reason: str | None, include_usage: bool) -> dict:
        out = {**self.base(), "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
        if include_usage:
            out["usage"] = None
        return out

    def full(self, f: Final) -> dict:
        return {**self.base(), "choices": [{"index": 0, "text": self.echo + f.text, "logprobs": None,
                                            "finish_reason": f.finish_reason}], "usage": _usage(f)}


# --- metrics middleware --------------------------------------------------------------------------

class _RequestMetricsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware) so streaming and disconnect detection pass through untouched."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in _KNOWN_ENDPOINTS else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
            model = (scope.get("state") or {}).get("model", "")
            self.metrics.observe_request(str(model)[:64], endpoint, status["code"])
