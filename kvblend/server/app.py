"""The OpenAI-compatible HTTP app: ``create_app(config)`` builds everything; nothing
lives in module globals.

Request flow: validate (pydantic) -> authenticate (bearer key -> namespace) -> resolve the model id
to a backend -> ``backend.open(job)`` (queues, waits for prefill: errors become proper 4xx before
any byte is sent) -> stream ``Delta`` events as SSE, or collect them into one JSON body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvblend.config import ServerConfig
from kvblend.server import errors, unsupported
from kvblend.server.anthropic import anthropic_router
from kvblend.server.auth import Authenticator, Principal
from kvblend.server.backends import Backend, Delta, Final, GenerationJob, document_id
from kvblend.server.factory import create_backends, create_store
from kvblend.server.limits import has_valid_key, install_gate, until_disconnect
from kvblend.server.logprobs import chat_logprobs, chat_setting, completion_logprobs
from kvblend.server.metrics import Metrics, probe_remote_tiers
from kvblend.server.model_info import max_model_len, model_info
from kvblend.server.openapi import install_openapi
from kvblend.server.reuse_warning import warn
from kvblend.server.schemas import (
    ChatCompletionRequest,
    ChunkInfo,
    ChunksRequest,
    ChunksResponse,
    CompletionRequest,
    Document,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
)
from kvblend.server.tokenize import tokenize_router
from kvblend.server.upstream import upstream_for, upstream_health

log = logging.getLogger(__name__)

ERROR_RESPONSES: dict = {code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 500, 503)}
_KNOWN_ENDPOINTS = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/chunks",
    "/v1/messages",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
}
_NOT_COUNTED = {"/health", "/metrics"}


class ServerState:
    """Everything a request handler needs; one instance per app."""

    def __init__(self, config: ServerConfig, backends: list[Backend], store):
        self.config = config
        self.backends = backends
        self.store = store
        self.by_id: dict[str, Backend] = {}
        self.ready = False
        self.auth = Authenticator(config.api_keys)
        self.metrics = Metrics(self.queue_depths, self.store_stats, self.model_info)
        self.metrics.register_fidelity(self.fidelity_stats)

    def model_info(self) -> list[dict[str, str]]:
        """Labels of ``kvblend_model_info``: one entry per served model."""
        return [model_info(b) for b in self.by_id.values()]

    def queue_depths(self) -> dict[str, tuple[int, int]]:
        """{model: (waiting, active)} for the scrape-time gauges."""
        return {b.id: (b.queue_depth(), b.active()) for b in self.by_id.values()}

    def fidelity_stats(self) -> dict[str, dict]:
        """{model: agreement stats} of the local models that report them
        (kvblend/engine/fidelity.py)."""
        return {
            b.id: s
            for b in self.by_id.values()
            if (s := getattr(b, "fidelity_stats", lambda: None)())
        }

    def store_stats(self) -> dict:
        if self.store is None or not hasattr(self.store, "stats"):
            return {}
        probe_remote_tiers(self.store)  # Redis reachability, measured at scrape time
        return self.store.stats()

    def resolve(self, model: str | None) -> Backend:
        if not self.ready:
            raise errors.unavailable(
                "the server is still loading its models", self.config.retry_after_s
            )
        if model is None and len(self.by_id) == 1:
            return next(iter(self.by_id.values()))
        if not model:  # several models served: the caller must say which
            served = ", ".join(sorted(self.by_id))
            raise errors.invalid_request(
                f"Missing required parameter: 'model' (one of: {served}).",
                "model",
                "missing_required_parameter",
            )
        backend = self.by_id.get(model)
        if backend is None:
            raise errors.model_not_found(str(model), sorted(self.by_id))
        return backend


def create_app(
    config: ServerConfig,
    backends: list[Backend] | None = None,
    store=None,
    on_ready: Callable[[list[Backend]], None] | None = None,
) -> FastAPI:
    """Build the app. ``backends`` (tests) replaces the ones the config describes;
    ``on_ready`` is called with the loaded backends once every model serves (the CLI prints
    its start-up summary there)."""
    if backends is None:
        store = create_store(config.store) if store is None else store
        backends = create_backends(config, store)
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
        if on_ready is not None:
            on_ready(state.backends)
        try:
            yield
        finally:
            state.ready = False
            for b in state.backends:
                b.close()

    app = FastAPI(
        title="kvblend",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible server with CacheBlend chunk KV reuse.",
    )
    app.state.kvblend = state
    errors.install_error_handlers(app)
    app.include_router(
        anthropic_router(state)
    )  # POST /v1/messages (Anthropic-shaped errors of its own)
    install_gate(app, state)  # drain 503 > auth 401 > 413 > JSON 400, before any route (limits.py)
    install_openapi(app)  # /openapi.json as the server behaves (openapi.py)
    app.add_middleware(_RequestMetricsMiddleware, metrics=state.metrics)
    auth = Depends(state.auth)

    @app.get("/health", response_model=Health, responses=ERROR_RESPONSES)
    async def health(request: Request) -> Any:
        if not state.ready or state.lifecycle.draining:
            raise errors.unavailable("draining for shutdown" if state.ready else "loading models")
        # hosts, ports and upstream model names only for callers with a key (or with auth off)
        detailed = has_valid_key(state, request)
        upstreams = await upstream_health(state.by_id.values(), detailed) or None
        degraded = any(not u.get("reachable") for u in (upstreams or {}).values())
        engines = {
            i: getattr(b, "engine", None) for i, b in state.by_id.items()
        }  # local models only
        attention = {
            i: {"kernel": e.attention_kernel, "reason": getattr(e, "attention_kernel_reason", None)}
            for i, e in engines.items()
            if hasattr(e, "attention_kernel")
        }
        return Health(
            status="degraded" if degraded else "ok",
            models=list(state.by_id),
            upstreams=upstreams,
            attention=attention or None,
        )

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)  # a Redis probe may wait on a socket
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def list_models(_: Principal = auth) -> Any:
        return ModelList(data=[_card(b) for b in state.by_id.values()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def get_model(model_id: str, _: Principal = auth) -> Any:
        return _card(state.resolve(model_id))

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, principal: Principal = auth
    ) -> Any:
        if (
            upstream := upstream_for(state, body.model)
        ) is not None:  # relayed as is (kvblend/server/upstream.py)
            return await upstream.forward(request, "/chat/completions", state.metrics)
        _check_common(body)
        unsupported.check_chat(body)
        backend = state.resolve(body.model)
        request.state.model = backend.id  # resolved ids only: metric labels stay bounded
        job = _chat_job(body, principal)
        job.max_tokens = body.max_completion_tokens or body.max_tokens
        job.logprobs = chat_setting(body.logprobs, body.top_logprobs)
        return await _respond(
            request, state, backend, job, body.stream, _include_usage(body), _ChatFormat(backend.id)
        )

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(
        body: CompletionRequest, request: Request, principal: Principal = auth
    ) -> Any:
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
        job.logprobs = body.logprobs
        echo = prompt if body.echo and isinstance(prompt, str) else ""
        return await _respond(
            request,
            state,
            backend,
            job,
            body.stream,
            _include_usage(body),
            _CompletionFormat(backend.id, echo),
        )

    @app.post("/v1/chunks", response_model=ChunksResponse, responses=ERROR_RESPONSES)
    async def chunks(body: ChunksRequest, request: Request, principal: Principal = auth) -> Any:
        backend = state.resolve(body.model)
        request.state.model = backend.id
        docs = [_document(d) for d in body.documents]
        if any(not d.text for d in docs):
            raise errors.invalid_request("documents must have non-empty text.", "documents")
        infos = await until_disconnect(
            request, backend.precompute([d.text for d in docs], principal.namespace)
        )
        data = [
            ChunkInfo(
                id=d.id or document_id(d.text),
                num_tokens=int(i["num_tokens"]),
                cached=bool(i.get("cached", False)),
                key=i.get("key"),
            )
            for d, i in zip(docs, infos)
        ]
        total = sum(c.num_tokens for c in data)
        return ChunksResponse(
            model=backend.id, data=data, usage={"prompt_tokens": total, "total_tokens": total}
        )

    app.include_router(tokenize_router(state))  # POST /tokenize, /detokenize (vLLM's)
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
        documents=[_document(d).text for d in body.documents or []],
        max_tokens=body.max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=[s for s in stop if s],
        seed=body.seed,
        mode=body.mode,
        recompute_ratio=body.recompute_ratio,
        selection=body.selection,
        fidelity=body.fidelity,
        namespace=principal.namespace,
    )


def _chat_job(body: ChatCompletionRequest, principal: Principal) -> GenerationJob:
    messages: list[dict] = []
    for i, m in enumerate(body.messages):
        content: Any = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise errors.invalid_request(
                        f"Only text content parts are supported (got {part.type!r}).",
                        f"messages[{i}].content[{j}]",
                    )
            content = [{"type": "text", "text": p.text} for p in content]
        messages.append(
            {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        )
    job = _sampling_job(body, principal)
    job.messages = messages
    return job


def _card(b: Backend) -> ModelCard:
    return ModelCard(
        id=b.id, created=b.created, owned_by=b.owned_by, max_model_len=max_model_len(b)
    )


# --- responding ----------------------------------------------------------------------------------


async def _respond(
    request: Request,
    state: ServerState,
    backend: Backend,
    job: GenerationJob,
    stream: bool | None,
    include_usage: bool,
    fmt: "_ChatFormat | _CompletionFormat",
) -> Response:
    timer = state.metrics.timer(backend.id, time.perf_counter())
    gen = await until_disconnect(request, backend.open(job))
    timer.first_token(job.queue_s)  # open() returns once the first token exists
    headers = warn(state, backend.id, gen)
    if stream:
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return StreamingResponse(
            _sse(timer, gen, fmt, include_usage), media_type="text/event-stream", headers=headers
        )

    async def collect() -> Final:
        try:
            async for ev in gen.events():
                if isinstance(ev, Final):
                    timer.finish(ev.kvblend, ev.prompt_tokens, ev.completion_tokens)
                    return ev
                timer.token()
        finally:
            _finish_cut(timer, gen)
        raise errors.internal_error()

    final = await until_disconnect(request, collect())
    return JSONResponse(fmt.full(final), headers=headers)


def _finish_cut(timer, gen) -> None:
    """A generation that ended without its Final (client gone, error): count what was generated."""
    if not timer.done:
        stats = getattr(gen, "stats", None)
        prompt_tokens = int(getattr(stats, "prompt_tokens", 0) or 0)
        timer.finish(None, prompt_tokens, int(getattr(gen, "num_tokens", 0)))


async def _sse(timer, gen, fmt, include_usage: bool) -> AsyncIterator[str]:
    try:
        opening = fmt.opening()
        if opening is not None:  # chat opens with the assistant role; completions only when echoing
            yield _data(fmt.chunk(opening, None, include_usage))
        async for ev in gen.events():
            if isinstance(ev, Delta):
                timer.token()
                yield _data(fmt.chunk(fmt.delta(ev.text), None, include_usage, ev.logprobs))
            else:
                timer.finish(ev.kvblend, ev.prompt_tokens, ev.completion_tokens)
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
        _finish_cut(timer, gen)
        gen.cancel()  # client gone (GeneratorExit / CancelledError) or done: free the sequence


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _usage(f: Final) -> dict:
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
        "kvblend": f.kvblend,
    }


class _ChatFormat:
    def __init__(self, model: str):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def base(self) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def opening(self) -> dict:
        return {"role": "assistant", "content": ""}

    def delta(self, text: str) -> dict:
        return {"content": text}

    def closing(self) -> dict:
        return {}

    def chunk(
        self, delta: dict, finish_reason: str | None, include_usage: bool, logprobs=None
    ) -> dict:
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        out = {**self.base(), "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def full(self, f: Final) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f.text, "refusal": None},
                    "logprobs": chat_logprobs(f.logprobs),
                    "finish_reason": f.finish_reason,
                }
            ],
            "usage": _usage(f),
        }


class _CompletionFormat:
    def __init__(self, model: str, echo: str = ""):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.echo = echo
        self.offset = len(echo)  # text_offset of the next delta's first token (logprobs)
        self.delta_offset = self.offset

    def base(self) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def opening(self) -> str | None:
        return self.echo or None

    def delta(self, text: str) -> str:
        self.delta_offset, self.offset = self.offset, self.offset + len(text)
        return text

    def closing(self) -> str:
        return ""

    def chunk(
        self, text: str, finish_reason: str | None, include_usage: bool, logprobs=None
    ) -> dict:
        lp = completion_logprobs(logprobs, self.delta_offset)
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        out = {**self.base(), "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def full(self, f: Final) -> dict:
        return {
            **self.base(),
            "choices": [
                {
                    "index": 0,
                    "text": self.echo + f.text,
                    "logprobs": completion_logprobs(f.logprobs, len(self.echo)),
                    "finish_reason": f.finish_reason,
                }
            ],
            "usage": _usage(f),
        }


# --- metrics middleware --------------------------------------------------------------------------


class _RequestMetricsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware) so streaming and disconnect detection pass
    through untouched."""

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

        if scope.get("path") in _NOT_COUNTED:  # health probes and scrapes are not traffic
            return await self.app(scope, receive, send)
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope.get("path", "")
            endpoint = (
                path
                if path in _KNOWN_ENDPOINTS
                else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
            )
            model = (scope.get("state") or {}).get("model", "")
            self.metrics.observe_request(str(model)[:64], endpoint, status["code"])
