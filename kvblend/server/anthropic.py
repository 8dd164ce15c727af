"""Anthropic Messages API: ``POST /v1/messages`` on top of the same backends as
the OpenAI endpoints.

A Messages request becomes OpenAI-style chat messages with text content parts and goes through
``backend.open(job)`` like ``/v1/chat/completions``: for a local model, the text blocks of the
last user message are chunks exactly like OpenAI content parts (every block but the last is a
cached chunk, the last is the question); ``system`` (string or text blocks) becomes the system
message. For an upstream model the job becomes a streamed OpenAI chat request to the upstream
(see ``upstream.py``).

Usage follows Anthropic's meaning: ``input_tokens`` are the prompt tokens *not* read from the cache,
``cache_read_input_tokens`` the ones whose KV was reused from the chunk store (OpenAI's
``cached_tokens``), so input_tokens + cache_read_input_tokens = the whole prompt.
``cache_creation_input_tokens`` is always 0: kvblend stores every missed chunk as a side effect of
prefill, without billing or counting it separately. kvblend's own prefill stats ride along as
``usage.kvblend``.

stop_reason: "stop" -> end_turn, "length" -> max_tokens, a stop sequence -> stop_sequence (with
``stop_sequence`` set). For local models stop sequences are matched here, on the generated text (the
generation is cancelled at the match); upstreams get them as OpenAI ``stop`` and report
stop_sequence only when they say which one matched (vLLM's ``stop_reason``), else end_turn.

Errors are Anthropic-shaped: ``{"type": "error", "error": {"type": ..., "message": ...}}`` with the
same HTTP status the OpenAI endpoints would use. Auth: ``x-api-key`` or ``Authorization: Bearer``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvblend.engine.detokenizer import partial_suffix
from kvblend.server import errors
from kvblend.server.backends import Delta, Final, GenerationJob
from kvblend.server.limits import until_disconnect
from kvblend.server.reuse_warning import warn
from kvblend.server.schemas import Selection

log = logging.getLogger(__name__)


class ContentBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    source: dict[str, Any] | None = None  # document blocks
    title: str | None = None


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # accepted, ignored
    metadata: dict | None = None
    tools: list | None = None
    tool_choice: dict | None = None
    # kvblend extensions (anthropic SDK: extra_body)
    documents: list[str] | None = None
    mode: Literal["full", "prefix", "reuse", "blend"] | None = None
    recompute_ratio: float | None = Field(default=None, ge=0, le=1)
    selection: Selection | None = None
    fidelity: float | None = Field(default=None, gt=0, le=1)


def anthropic_router(state) -> APIRouter:
    """``POST /v1/messages`` bound to the app's ``ServerState`` (auth, backends, metrics)."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:
            principal = _authenticate(state.auth, request)
            body = _parse(await request.body())
            backend = state.resolve(body.model)
            request.state.model = backend.id
            local_stops = not hasattr(
                backend, "forward"
            )  # local engines: stop sequences matched here
            job = to_job(body, principal.namespace, send_stops=not local_stops)
            timer = state.metrics.timer(backend.id, time.perf_counter())
            gen = await until_disconnect(request, backend.open(job))  # a client gone: work stops
            timer.first_token(job.queue_s)
            headers = warn(state, backend.id, gen)
            stops = list(body.stop_sequences or []) if local_stops else []
            run = _Run(timer, backend, gen, stops, body.stop_sequences or [])
            if body.stream:
                headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                return StreamingResponse(run.sse(), media_type="text/event-stream", headers=headers)
            return JSONResponse(await until_disconnect(request, run.message()), headers=headers)
        except errors.APIError as e:
            return errors.anthropic_error_response(e)
        except Exception:
            log.exception("/v1/messages failed")
            return errors.anthropic_error_response(errors.internal_error())

    return router


def _authenticate(auth, request: Request):
    key = request.headers.get("x-api-key")
    if key is not None and key.strip():
        return auth.authenticate(f"Bearer {key.strip()}")
    if auth.enabled and not request.headers.get("authorization"):
        raise errors.APIError(
            401,
            "Missing API key: send it in the x-api-key header (or Authorization: Bearer).",
            "invalid_request_error",
            None,
            "missing_api_key",
        )
    return auth.authenticate(request.headers.get("authorization"))


def _parse(raw: bytes) -> MessagesRequest:
    try:
        data = json.loads(raw or b"null")
    except ValueError:
        raise errors.invalid_request("The request body is not valid JSON.") from None
    if not isinstance(data, dict):
        raise errors.invalid_request("The request body must be a JSON object.")
    try:
        return MessagesRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        if first.get("type") == "missing":
            raise errors.invalid_request(f"{where}: Field required", where) from None
        raise errors.invalid_request(
            f"{where}: {first.get('msg', 'invalid value')}", where
        ) from None


def _blocks(blocks: list[ContentBlock], where: str) -> list[dict]:
    out = []
    for j, b in enumerate(blocks):
        if b.type == "document":
            out += _document_parts(b, f"{where}.{j}")
        elif b.type != "text" or b.text is None:
            raise errors.invalid_request(
                f"{where}.{j}: only text and text document blocks are supported (got {b.type!r}).",
                f"{where}.{j}",
            )
        else:
            out.append({"type": "text", "text": b.text})
    return out


def _document_parts(b: ContentBlock, where: str) -> list[dict]:
    """A ``document`` block -> text parts: its title (a part of its own, so the document's chunk
    is the one ``documents`` or ``/v1/chunks`` store for the same text), then its text."""
    src = b.source or {}
    if src.get("type") == "text" and isinstance(src.get("data"), str):
        texts = [src["data"]]
    elif src.get("type") == "content" and isinstance(src.get("content"), (str, list)):
        content = src["content"]
        texts = (
            [content]
            if isinstance(content, str)
            else [
                c.get("text", "")
                for c in content
                if isinstance(c, dict) and c.get("type") == "text"
            ]
        )
        if isinstance(content, list) and len(texts) != len(content):
            raise errors.invalid_request(
                f"{where}.source: only text content is supported.", f"{where}.source"
            )
    else:
        raise errors.invalid_request(
            f"{where}.source: only text documents (source type 'text' or 'content') are supported "
            f"(got {src.get('type')!r}).",
            f"{where}.source",
        )
    title = [{"type": "text", "text": b.title}] if b.title else []
    return title + [{"type": "text", "text": t} for t in texts if t]


def to_openai_messages(body: MessagesRequest) -> list[dict]:
    """Anthropic system + messages -> OpenAI chat messages; text blocks stay
    separate content parts."""
    out: list[dict] = []
    if isinstance(body.system, str) and body.system:
        out.append({"role": "system", "content": body.system})
    elif isinstance(body.system, list) and body.system:
        out.append({"role": "system", "content": _blocks(body.system, "system")})
    for i, m in enumerate(body.messages):
        content = (
            m.content if isinstance(m.content, str) else _blocks(m.content, f"messages.{i}.content")
        )
        out.append({"role": m.role, "content": content})
    if out[-1]["role"] != "user":
        raise errors.invalid_request(
            "messages must end with a user message (assistant prefill is not supported).",
            "messages",
        )
    return out


def to_job(body: MessagesRequest, namespace: str, send_stops: bool) -> GenerationJob:
    if body.tools:
        raise errors.invalid_request("tools are not supported by this server.", "tools")
    if body.tool_choice and body.tool_choice.get("type") != "none":
        raise errors.invalid_request("tool_choice is not supported by this server.", "tool_choice")
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0
    return GenerationJob(
        messages=to_openai_messages(body),
        documents=list(body.documents or []),
        max_tokens=body.max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=[s for s in body.stop_sequences or [] if s] if send_stops else [],
        mode=body.mode,
        recompute_ratio=body.recompute_ratio,
        selection=body.selection,
        fidelity=body.fidelity,
        namespace=namespace,
    )


class _StopScanner:
    """Finds the earliest stop sequence in streamed text, holding back a possible partial match."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        if not self.stops:
            return text, None
        self.buf += text
        hits = [(self.buf.find(s), s) for s in self.stops if s in self.buf]
        if hits:
            at, stop = min(hits)
            out, self.buf = self.buf[:at], ""
            return out, stop
        hold = max(partial_suffix(self.buf, s) for s in self.stops)
        out, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold :]
        return out, None

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class _Run:
    """One generation, consumed once, as an Anthropic message or its SSE events."""

    def __init__(self, timer, backend, gen, local_stops: list[str], stop_sequences: list[str]):
        self.timer, self.backend, self.gen = timer, backend, gen
        self.scanner = _StopScanner(local_stops)
        self.stop_sequences = stop_sequences
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.final: Final | None = None
        self.stop_sequence: str | None = None
        self.deltas = 0

    async def pieces(self) -> AsyncIterator[str]:
        """Text to send, in order; sets ``final`` / ``stop_sequence`` when the generation ends."""
        events = self.gen.events()
        try:
            async for ev in events:
                if isinstance(ev, Delta):
                    self.timer.token()
                    self.deltas += 1
                    text, stop = self.scanner.feed(ev.text)
                    if text:
                        yield text
                    if stop is not None:
                        self.stop_sequence = stop
                        return  # finally cancels the rest of the generation
                elif isinstance(ev, Final):
                    self.final = ev
                    rest = self.scanner.flush()
                    if rest:
                        yield rest
                    matched = getattr(self.gen, "matched_stop", None)
                    if ev.finish_reason == "stop" and matched in self.stop_sequences:
                        self.stop_sequence = matched
                    return
        finally:
            await events.aclose()
            self.gen.cancel()
            self._observe()

    def _observe(self) -> None:
        f = self.final
        if f is not None:
            self.timer.finish(f.kvblend, f.prompt_tokens, f.completion_tokens)
            return
        stats = getattr(self.gen, "stats", None)  # cut at a stop sequence or by the client
        self.timer.finish(
            stats.as_dict() if hasattr(stats, "as_dict") else None,
            int(getattr(stats, "prompt_tokens", 0) or 0),
            int(getattr(self.gen, "num_tokens", self.deltas)),
        )

    def stop_reason(self) -> str:
        if self.stop_sequence is not None:
            return "stop_sequence"
        if self.final is not None and self.final.finish_reason == "length":
            return "max_tokens"
        return "end_turn"

    def usage(self) -> dict[str, Any]:
        f = self.final
        if f is not None:
            prompt, cached, out, kv = (
                f.prompt_tokens,
                f.cached_tokens,
                f.completion_tokens,
                f.kvblend,
            )
        else:
            # cut short at a local stop sequence: prefill stats from the stream, output counted here
            stats = getattr(self.gen, "stats", None)
            prompt = int(getattr(stats, "prompt_tokens", 0) or 0)
            cached = int(getattr(stats, "cached_tokens", 0) or 0)
            out, kv = self.deltas, (stats.as_dict() if hasattr(stats, "as_dict") else None)
        usage = {
            "input_tokens": max(0, prompt - cached),
            "output_tokens": out,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }
        if kv:
            usage["kvblend"] = kv
        return usage

    def _start_usage(self) -> dict[str, Any]:
        stats = getattr(
            self.gen, "stats", None
        )  # local: known at prefill; upstream: only at the end
        prompt = int(getattr(stats, "prompt_tokens", 0) or 0)
        cached = int(getattr(stats, "cached_tokens", 0) or 0)
        return {
            "input_tokens": max(0, prompt - cached),
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def _message(self, content: list[dict], stop_reason: str | None, usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.backend.id,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": self.stop_sequence if stop_reason == "stop_sequence" else None,
            "usage": usage,
        }

    async def message(self) -> dict:
        text = "".join([p async for p in self.pieces()])
        return self._message([{"type": "text", "text": text}], self.stop_reason(), self.usage())

    async def sse(self) -> AsyncIterator[str]:
        try:
            yield _event(
                "message_start",
                {"type": "message_start", "message": self._message([], None, self._start_usage())},
            )
            yield _event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            )
            yield _event("ping", {"type": "ping"})
            async for text in self.pieces():
                yield _event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "text_delta", "text": text},
                    },
                )
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            reason = self.stop_reason()
            yield _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": reason,
                        "stop_sequence": self.stop_sequence if reason == "stop_sequence" else None,
                    },
                    "usage": self.usage(),
                },
            )
            yield _event("message_stop", {"type": "message_stop"})
        except (
            errors.APIError
        ) as e:  # headers are gone: Anthropic reports in-band with an error event
            yield _event(
                "error",
                {
                    "type": "error",
                    "error": {"type": errors.anthropic_error_type(e.status), "message": e.message},
                },
            )
        except Exception:
            log.exception("/v1/messages stream failed")
            e = errors.internal_error()
            yield _event(
                "error", {"type": "error", "error": {"type": "api_error", "message": e.message}}
            )
        finally:
            self.gen.cancel()  # client gone mid-stream: free the sequence / close the upstream now


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"
