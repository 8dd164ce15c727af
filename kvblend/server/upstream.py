"""Upstream models: a model id served by another OpenAI-compatible service (``kind: upstream``).

Two ways in:

* ``forward`` — pass-through for ``/v1/chat/completions`` and ``/v1/completions``: the client's
  JSON body goes upstream as is, except ``model`` (rewritten to ``upstream_model``) and the key
  (the client's key was checked by kvblend; the upstream gets its own, read from the env var named
  by ``api_key_env``). Streams are relayed event by event with ``model`` rewritten back to the
  gateway id; usage is kept.
* ``open(job)`` — the ``Backend`` interface (``GenerationJob`` in, ``Delta`` / ``Final`` out),
  used by the Anthropic ``/v1/messages`` adapter: the job becomes a streamed OpenAI chat request.

Failures become OpenAI error bodies that name the upstream (``id`` and
``host:port``, never the key):

====================================  ======  ===========================
upstream outcome                      status  code
====================================  ======  ===========================
cannot connect (after retries)        502     upstream_unreachable
connect / read timeout                504     upstream_timeout
broken connection mid-request         502     upstream_error
401 / 403                             502     upstream_auth_failed
404                                   502     upstream_model_not_found
429                                   429     upstream_rate_limited (Retry-After kept)
400 / 413 / 422                       400     the upstream's code, else upstream_bad_request
503                                   503     upstream_unavailable (Retry-After kept)
408 / 504                             504     upstream_timeout
other 4xx / 5xx, non-JSON 200         502     upstream_error
====================================  ======  ===========================

Retries (``retries``, default 2, short backoff) happen only for connection failures, i.e. before any
byte of the request was sent; nothing that may have reached the upstream is ever repeated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvblend.config import ModelEntry, ServerConfig, read_secret_env
from kvblend.server import errors
from kvblend.server.backends import BackendEvent, Delta, Final, GenerationJob

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 2.0
HEALTH_CACHE_S = 2.0  # /health is polled often; probe each upstream at most this often


class UpstreamBackend:
    """A model id forwarded to ``entry.base_url``. Implements the ``Backend`` protocol
    plus ``forward``."""

    owned_by = "upstream"

    def __init__(
        self,
        entry: ModelEntry,
        config: ServerConfig | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.entry = entry
        self.config = config
        self.id = entry.id
        self.created = int(time.time())
        self.base_url = entry.base_url.rstrip("/")
        parts = urlsplit(self.base_url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        self.host = (
            f"{parts.hostname}:{port}"  # never userinfo: a key in the URL must not leak into errors
        )
        self.upstream_model = entry.upstream_model or entry.id
        self._transport = transport  # tests: httpx.MockTransport
        self._key = ""
        self._redactor = Redactor("")
        self._client: httpx.AsyncClient | None = None
        self._inflight = 0
        self._health: tuple[float, dict] | None = None

    @property
    def label(self) -> str:
        return f"upstream {self.id!r} ({self.host})"

    # --- Backend lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self.entry.api_key_env:
            self._key = read_secret_env(self.entry.api_key_env)
            self._redactor = Redactor(self._key)
            if not self._key:
                raise ValueError(
                    f"model {self.id!r}: environment variable {self.entry.api_key_env} "
                    "(its api_key_env) is not set or empty"
                )

    def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            asyncio.get_running_loop().create_task(client.aclose())
        except (
            RuntimeError
        ):  # no loop (tests calling close() directly): nothing pooled can be in use
            pass

    def queue_depth(self) -> int:
        return 0  # nothing waits here: the upstream queues

    def active(self) -> int:
        return self._inflight

    async def precompute(self, documents: list[str], namespace: str) -> list[dict]:
        raise errors.invalid_request(
            f"model {self.id!r} is served by an upstream; /v1/chunks precomputes "
            "documents for local models only.",
            "model",
            "unsupported_for_upstream",
        )

    # --- HTTP -------------------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            timeout = httpx.Timeout(
                self.entry.timeout_s, connect=min(CONNECT_TIMEOUT_S, self.entry.timeout_s)
            )
            # trust_env=False: kvblend reads the environment only in kvblend/config.py
            # (no proxy surprises).
            self._client = httpx.AsyncClient(
                timeout=timeout, transport=self._transport, trust_env=False
            )
        return self._client

    def _headers(self, stream: bool) -> dict[str, str]:
        h = {"Accept": "text/event-stream" if stream else "application/json"}
        if self._key:
            h["Authorization"] = f"Bearer {self._key}"
        return h

    async def _send(self, path: str, body: dict, stream: bool) -> httpx.Response:
        """POST with retries on connection failures only; any HTTP status is
        returned, not raised."""
        client = self._http()
        attempts = 1 + self.entry.retries
        last: Exception | None = None
        for attempt in range(attempts):
            req = client.build_request(
                "POST", self.base_url + path, json=body, headers=self._headers(stream)
            )
            try:
                return await client.send(req, stream=stream)
            except (
                httpx.ConnectError,
                httpx.ConnectTimeout,
            ) as e:  # nothing was sent: safe to retry
                last = e
                if attempt + 1 < attempts:
                    await asyncio.sleep(min(0.1 * 2**attempt, 1.0))
            except httpx.TimeoutException as e:
                raise self.timeout_error(e) from None
            except httpx.HTTPError as e:
                raise self.transport_error(e) from None
        if isinstance(last, httpx.ConnectTimeout):
            raise self.timeout_error(last, attempts)
        raise self.unreachable_error(last, attempts)

    # --- error mapping ----------------------------------------------------------------------------

    def unreachable_error(self, exc: BaseException | None, attempts: int = 1) -> errors.APIError:
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        why = self._redact(_reason(exc))
        return errors.APIError(
            502,
            f"{self.label} is unreachable: {why}{tries}.",
            "server_error",
            None,
            "upstream_unreachable",
        )

    def timeout_error(self, exc: BaseException | None, attempts: int = 1) -> errors.APIError:
        what = "connecting" if isinstance(exc, httpx.ConnectTimeout) else "waiting for a response"
        tries = f" ({attempts} attempts)" if attempts > 1 else ""
        limit = (
            min(CONNECT_TIMEOUT_S, self.entry.timeout_s)
            if isinstance(exc, httpx.ConnectTimeout)
            else self.entry.timeout_s
        )
        return errors.APIError(
            504,
            f"{self.label} timed out {what} (limit {limit:g}s){tries}.",
            "server_error",
            None,
            "upstream_timeout",
        )

    def transport_error(self, exc: BaseException) -> errors.APIError:
        why = self._redact(_reason(exc))
        return errors.APIError(
            502, f"{self.label} failed mid-request: {why}.", "server_error", None, "upstream_error"
        )

    def status_error(
        self, status: int, content: bytes, headers: httpx.Headers | dict
    ) -> errors.APIError:
        """An upstream HTTP error status -> the error the gateway's client gets (see
        the module table)."""
        msg, param, code = _upstream_error(content, self._redact)  # masked before it is cut short
        detail = f"HTTP {status}: {msg}" if msg else f"HTTP {status}"
        retry = {"Retry-After": headers["retry-after"]} if "retry-after" in headers else {}
        if status in (401, 403):
            where = (
                f"the key in environment variable {self.entry.api_key_env}"
                if self.entry.api_key_env
                else "no key (api_key_env is not set for this model)"
            )
            return errors.APIError(
                502,
                f"{self.label} rejected the gateway's credentials ({detail}). The gateway "
                f"sent {where}; fix it in the gateway's configuration.",
                "server_error",
                None,
                "upstream_auth_failed",
            )
        if status == 404:
            return errors.APIError(
                502,
                f"{self.label} answered 404 for model {self.upstream_model!r} ({detail}). "
                "Check upstream_model and base_url in the gateway's configuration.",
                "server_error",
                None,
                "upstream_model_not_found",
            )
        if status == 429:
            return errors.APIError(
                429,
                f"{self.label} is rate limiting requests ({detail}).",
                "rate_limit_error",
                None,
                "upstream_rate_limited",
                retry,
            )
        if status in (400, 413, 422):
            return errors.APIError(
                400,
                f"{self.label} rejected the request ({detail}).",
                "invalid_request_error",
                param,
                code or "upstream_bad_request",
            )
        if status == 503:
            return errors.APIError(
                503,
                f"{self.label} is unavailable ({detail}).",
                "server_error",
                None,
                "upstream_unavailable",
                retry or {"Retry-After": "1"},
            )
        if status in (408, 504):
            return errors.APIError(
                504, f"{self.label} timed out ({detail}).", "server_error", None, "upstream_timeout"
            )
        return errors.APIError(
            502, f"{self.label} failed ({detail}).", "server_error", None, "upstream_error"
        )

    def _redact(self, text: str) -> str:
        return self._redactor.text(text)

    # --- pass-through (OpenAI endpoints) --------------------------------------------------------

    async def forward(self, request: Request, path: str, metrics=None) -> Response:
        """Relay the client's request body to ``base_url + path`` (``/chat/completions`` |
        ``/completions``)."""
        request.state.model = self.id
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise errors.invalid_request(
                "We could not parse the JSON body of your request."
            ) from None
        if not isinstance(body, dict):
            raise errors.invalid_request("The request body must be a JSON object.")
        body["model"] = self.upstream_model
        stream = bool(body.get("stream"))
        t0 = time.perf_counter()
        self._inflight += 1
        try:
            resp = await self._send(path, body, stream)
        except BaseException:
            self._inflight -= 1
            raise
        if not stream or "text/event-stream" not in resp.headers.get("content-type", ""):
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
                self._inflight -= 1
            return self._json_response(resp.status_code, content, resp.headers, metrics)
        if resp.status_code >= 400:  # an SSE content type with an error status: still an error
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
                self._inflight -= 1
            raise self.status_error(resp.status_code, content, resp.headers)
        return StreamingResponse(
            self._relay(resp, t0, metrics),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _json_response(self, status: int, content: bytes, headers, metrics) -> Response:
        if status >= 400:
            raise self.status_error(status, content, headers)
        try:
            obj = json.loads(content)
        except ValueError:
            raise errors.APIError(
                502,
                f"{self.label} returned a body that is not JSON (HTTP {status}).",
                "server_error",
                None,
                "upstream_error",
            ) from None
        obj = self._redactor.obj(obj)  # no byte of the upstream key goes back, whatever field
        if isinstance(obj, dict):
            if "model" in obj:
                obj["model"] = self.id
            if metrics is not None and isinstance(obj.get("usage"), dict):
                metrics.observe_generation(
                    self.id, None, int(obj["usage"].get("completion_tokens") or 0)
                )
        return JSONResponse(obj, status_code=status)

    async def _relay(self, resp: httpx.Response, t0: float, metrics) -> AsyncIterator[str]:
        """SSE events as they arrive, rebuilt from their parsed JSON (``model`` rewritten, every
        string masked): nothing the upstream wrote goes out verbatim. Comments, ``event:`` / ``id:``
        lines and non-JSON data are dropped. A broken upstream ends the stream with an error."""
        first, usage = True, None
        try:
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    yield "data: [DONE]\n\n"
                    continue
                obj = _json_or_none(payload)
                if not isinstance(obj, dict):
                    continue
                obj = self._redactor.obj(obj)
                if "model" in obj:
                    obj["model"] = self.id
                if first and _has_text(obj):
                    first = False
                    if metrics is not None:
                        metrics.ttft.labels(self.id).observe(time.perf_counter() - t0)
                if isinstance(obj.get("usage"), dict):
                    usage = obj["usage"]
                if isinstance(obj.get("error"), dict) and obj["error"].get("message"):
                    obj["error"]["message"] = f"{self.label}: {obj['error']['message']}"
                yield "data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n\n"
        except httpx.TimeoutException as e:
            yield _sse_error(self.timeout_error(e))
        except httpx.HTTPError as e:
            yield _sse_error(self.transport_error(e))
        finally:
            await (
                resp.aclose()
            )  # also when the client left: the upstream sees the disconnect and stops
            self._inflight -= 1
            if metrics is not None and usage:
                metrics.observe_generation(self.id, None, int(usage.get("completion_tokens") or 0))

    # --- Backend.open (jobs: the Anthropic adapter) -------------------------------------------

    async def open(self, job: GenerationJob) -> "UpstreamStream":
        chat = job.messages is not None
        body: dict[str, Any] = {"model": self.upstream_model}
        if chat:
            body["messages"] = job.messages
        else:
            body["prompt"] = job.prompt if job.prompt is not None else ""
        body.update(
            stream=True,
            stream_options={"include_usage": True},
            temperature=job.temperature,
            top_p=job.top_p,
        )
        if job.max_tokens:
            body["max_tokens"] = job.max_tokens
        if job.stop:
            body["stop"] = list(job.stop)
        if job.seed is not None:
            body["seed"] = job.seed
        if job.documents:  # kvblend extensions: only sent when the client used them
            body["documents"] = list(job.documents)
        if job.mode is not None:
            body["mode"] = job.mode
        if job.recompute_ratio is not None:
            body["recompute_ratio"] = job.recompute_ratio
        if job.fidelity is not None:
            body["fidelity"] = job.fidelity
        if job.selection is not None:
            body["selection"] = job.selection
        self._inflight += 1
        try:
            resp = await self._send(
                "/chat/completions" if chat else "/completions", body, stream=True
            )
            if resp.status_code >= 400:
                try:
                    content = await resp.aread()
                finally:
                    await resp.aclose()
                raise self.status_error(resp.status_code, content, resp.headers)
            if "text/event-stream" not in resp.headers.get("content-type", ""):
                # an upstream that ignores stream: true answers with one JSON body: use it whole
                try:
                    content = await resp.aread()
                finally:
                    await resp.aclose()
                body = self._completion_body(resp.status_code, content)
                return UpstreamStream(self, resp, chat, body=body)
        except BaseException:
            self._inflight -= 1
            raise
        return UpstreamStream(self, resp, chat)

    def _completion_body(self, status: int, content: bytes) -> dict:
        """A non-streamed chat / completion body, masked; 502 if it is not one."""
        obj = _json_or_none(content.decode("utf-8", "replace")) if content else None
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
            raise errors.APIError(
                502,
                f"{self.label} returned neither an event stream nor a completion (HTTP {status}).",
                "server_error",
                None,
                "upstream_error",
            )
        return self._redactor.obj(obj)

    # --- health -----------------------------------------------------------------------------------

    async def probe(self) -> dict:
        """Reachability for /health: GET base_url/models with a short timeout (cached briefly)."""
        now = time.monotonic()
        if self._health is not None and now - self._health[0] < HEALTH_CACHE_S:
            return self._health[1]
        t0 = time.perf_counter()
        out: dict[str, Any] = {
            "base_url": f"{urlsplit(self.base_url).scheme}://{self.host}",
            "model": self.upstream_model,
        }
        try:
            r = await self._http().get(
                self.base_url + "/models", headers=self._headers(False), timeout=HEALTH_TIMEOUT_S
            )
            out.update(
                reachable=True,
                status=r.status_code,
                auth_ok=r.status_code not in (401, 403),
                latency_ms=round((time.perf_counter() - t0) * 1000, 1),
            )
        except httpx.TimeoutException:
            out.update(reachable=False, error=f"no answer within {HEALTH_TIMEOUT_S:g}s")
        except httpx.HTTPError as e:
            out.update(reachable=False, error=self._redact(_reason(e)))
        self._health = (time.monotonic(), out)
        return out


class UpstreamStream:
    """One streamed upstream chat/completion as ``Delta`` events and a closing ``Final``."""

    def __init__(
        self, backend: UpstreamBackend, resp: httpx.Response, chat: bool, body: dict | None = None
    ):
        self.backend = backend
        self._resp = resp
        self._chat = chat
        self._body = body  # the whole answer, when the upstream did not stream
        self._done = False
        self.matched_stop: str | None = (
            None  # vLLM-style choices[0].stop_reason, when the upstream sends it
        )

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self.backend._inflight -= 1

    def cancel(self) -> None:
        if not self._done:
            self._finish()
            try:
                asyncio.get_running_loop().create_task(self._resp.aclose())
            except RuntimeError:
                pass

    async def events(self) -> AsyncIterator[BackendEvent]:
        if self._body is not None:
            async for ev in self._body_events():
                yield ev
            return
        b = self.backend
        text: list[str] = []
        finish, usage, chunks = None, None, 0
        try:
            async for line in self._resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                obj = _json_or_none(payload)
                if not isinstance(obj, dict):
                    continue
                if isinstance(obj.get("error"), dict):
                    raise errors.APIError(
                        502,
                        f"{b.label} failed mid-stream: "
                        f"{b._redact(str(obj['error'].get('message', '')))}",
                        "server_error",
                        None,
                        "upstream_error",
                    )
                if isinstance(obj.get("usage"), dict):
                    usage = obj["usage"]
                for c in obj.get("choices") or []:
                    piece = (
                        (c.get("delta") or {}).get("content") if self._chat else c.get("text")
                    ) or ""
                    if piece:
                        chunks += 1
                        text.append(piece)
                        yield Delta(piece)
                    if c.get("finish_reason"):
                        finish = c["finish_reason"]
                        if isinstance(c.get("stop_reason"), str):
                            self.matched_stop = c["stop_reason"]
        except httpx.TimeoutException as e:
            raise b.timeout_error(e) from None
        except httpx.HTTPError as e:
            raise b.transport_error(e) from None
        finally:
            self._finish()
            await self._resp.aclose()
        u = usage or {}
        details = u.get("prompt_tokens_details") or {}
        yield Final(
            finish or "stop",
            int(u.get("prompt_tokens") or 0),
            int(u.get("completion_tokens") or chunks),
            int(details.get("cached_tokens") or 0),
            "".join(text),
            u.get("kvblend") if isinstance(u.get("kvblend"), dict) else None,
        )

    async def _body_events(self) -> AsyncIterator[BackendEvent]:
        self._finish()
        obj = self._body
        choice = next((c for c in obj["choices"] if isinstance(c, dict)), {})
        if self._chat:
            piece = (choice.get("message") or {}).get("content") or ""
        else:
            piece = choice.get("text") or ""
        piece = piece if isinstance(piece, str) else ""
        if isinstance(choice.get("stop_reason"), str):
            self.matched_stop = choice["stop_reason"]
        if piece:
            yield Delta(piece)
        u = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
        details = u.get("prompt_tokens_details") or {}
        completion = int(u.get("completion_tokens") or (1 if piece else 0))
        yield Final(
            choice.get("finish_reason") or "stop",
            int(u.get("prompt_tokens") or 0),
            completion,
            int(details.get("cached_tokens") or 0),
            piece,
            u.get("kvblend") if isinstance(u.get("kvblend"), dict) else None,
        )


# --- helpers for the app -------------------------------------------------------------------------


def upstream_for(state, model: str | None) -> UpstreamBackend | None:
    """The upstream backend ``model`` names, if any (None: let the app's normal path handle it)."""
    if not getattr(state, "ready", False) or not model:
        return None
    backend = state.by_id.get(model)
    return backend if isinstance(backend, UpstreamBackend) else None


PUBLIC_HEALTH_FIELDS = ("reachable", "status", "latency_ms")


async def upstream_health(backends, detailed: bool = False) -> dict[str, dict]:
    """Per upstream id its probe; without ``detailed`` (a caller with no key) only whether it
    answers: never its host, port, upstream model name or error text."""
    ups = [b for b in backends if isinstance(b, UpstreamBackend)]
    results = await asyncio.gather(*(b.probe() for b in ups))
    if not detailed:
        results = [{k: r[k] for k in PUBLIC_HEALTH_FIELDS if k in r} for r in results]
    return {b.id: r for b, r in zip(ups, results)}


def _reason(exc: BaseException | None) -> str:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    text = " ".join(str(e) for e in chain)
    if any(isinstance(e, ConnectionRefusedError) for e in chain) or "refused" in text.lower():
        return "connection refused"
    if (
        "name or service not known" in text.lower()
        or "nodename nor servname" in text.lower()
        or "temporary failure in name resolution" in text.lower()
    ):
        return "host name not found (DNS)"
    if any(isinstance(e, httpx.RemoteProtocolError) for e in chain):
        return "the connection was closed unexpectedly"
    first = chain[0] if chain else None
    return f"{type(first).__name__}: {str(first)[:120]}" if first is not None else "unknown error"


def _upstream_error(content: bytes, redact=lambda t: t) -> tuple[str, str | None, str | None]:
    """(message, param, code) from an OpenAI- or Anthropic-shaped error body, or its text; every
    part goes through ``redact`` before it is shortened, so a cut never leaves part of a key."""
    try:
        body = json.loads(content)
    except (ValueError, RecursionError):
        return redact(content.decode("utf-8", "replace").strip())[:200], None, None
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail") or ""
            param = redact(err["param"])[:200] if isinstance(err.get("param"), str) else None
            code = redact(err["code"])[:100] if isinstance(err.get("code"), str) else None
            return redact(str(msg))[:300], param, code
        return redact(str(err))[:300], None, None
    return redact(str(body))[:300], None, None


class Redactor:
    """Masks a secret in text and in every string (keys included) of a parsed JSON value.

    Besides the whole key, any word holding ``WINDOW`` consecutive characters of it is masked whole,
    so a key cut short, or shown as a prefix and a suffix (``sk-abc...wxyz``), leaks nothing either.
    """

    WINDOW = 8
    MASK = "***"

    def __init__(self, key: str):
        self.key = key
        n = min(self.WINDOW, len(key))
        self._windows = {key[i : i + n] for i in range(len(key) - n + 1)} if key else set()

    def text(self, s: str) -> str:
        if not self.key or not s:
            return s
        s = s.replace(self.key, self.MASK)
        if not any(w in s for w in self._windows):
            return s
        return re.sub(
            r"\S+",
            lambda m: self.MASK if any(w in m.group(0) for w in self._windows) else m.group(0),
            s,
        )

    def obj(self, value: Any) -> Any:
        if not self.key:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.obj(v) for v in value]
        if isinstance(value, dict):
            return {self.text(str(k)): self.obj(v) for k, v in value.items()}
        return value


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _has_text(obj: dict) -> bool:
    for c in obj.get("choices") or []:
        if isinstance(c, dict) and ((c.get("delta") or {}).get("content") or c.get("text")):
            return True
    return False


def _sse_error(e: errors.APIError) -> str:
    return f"data: {json.dumps(e.body(), separators=(',', ':'), ensure_ascii=False)}\n\n"
