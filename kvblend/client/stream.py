"""Streaming chat client used by doctor and every benchmark: one request in, one
``StreamResult`` out.

TTFT is measured client-side as the time from sending the request to the first *non-empty* content
delta (role-only and usage-only chunks do not count), which is what a user of any OpenAI-compatible
server sees. Usage (including ``prompt_tokens_details.cached_tokens``) is requested with
``stream_options={"include_usage": True}`` and read from whichever chunk carries it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from kvblend.client.auth import Endpoint
from kvblend.policy import PrefillPolicy

# kvblend's per-request prefill fields (PrefillPolicy.request_fields) go top-level in extra_body. If
# the server moves them under one object, set OVERRIDE_NAMESPACE (e.g. "kvblend") and
# every caller follows.
OVERRIDE_NAMESPACE: str | None = None

PLACEHOLDER_KEY = "EMPTY"  # the openai client insists on a key; servers without auth ignore it


def parse_mode_spec(text: str) -> PrefillPolicy:
    """A prefill policy as the benches name their rows (``full``, ``blend@0.15/lookahead:8``, or
    ``default``: no override, the server's own default and the only choice for
    non-kvblend servers)."""
    return PrefillPolicy.parse(text)


def policy_extra_body(policy: PrefillPolicy) -> dict:
    """extra_body asking kvblend for ``policy``; {} for "default"."""
    fields = policy.request_fields()
    if not fields:
        return {}
    return {OVERRIDE_NAMESPACE: fields} if OVERRIDE_NAMESPACE else fields


def parse_mode_list(text: str) -> list[PrefillPolicy]:
    specs = [parse_mode_spec(t) for t in text.split(",") if t.strip()]
    if not specs:
        raise ValueError("no modes given")
    return specs


def merge_extra_body(*bodies: dict | None) -> dict | None:
    """Shallow merge, later wins; None when empty so the request carries no extra fields."""
    out: dict = {}
    for b in bodies:
        out.update(b or {})
    return out or None


@dataclass
class ChatRequest:
    messages: list[dict]
    max_tokens: int = 16
    temperature: float = 0.0
    extra_body: dict | None = None
    include_usage: bool = True  # some older servers reject stream_options; turn off for them


@dataclass
class StreamResult:
    text: str = ""
    ttft_s: float | None = None  # to the first non-empty content delta; None if none came
    total_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens when reported
    finish_reason: str | None = None
    chunks: int = 0
    empty_choice_chunks: int = 0  # chunks with choices == [] (usage chunk, keep-alives); tolerated
    error: str | None = None
    status_code: int | None = None  # HTTP status of a failed request
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict:
        return asdict(self)


def make_async_client(endpoint: Endpoint, max_retries: int | None = None):
    """An ``openai.AsyncOpenAI`` for the endpoint. Create it inside the event loop that uses it."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(
        base_url=endpoint.base_url,
        api_key=endpoint.api_key or PLACEHOLDER_KEY,
        timeout=endpoint.timeout,
        max_retries=endpoint.max_retries if max_retries is None else max_retries,
    )


def describe_error(exc: BaseException) -> tuple[str, int | None]:
    """(one-line message, HTTP status or None) for an openai / httpx failure."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        msg = getattr(exc, "message", None) or str(exc)
        return f"HTTP {exc.status_code}: {msg}", exc.status_code
    if isinstance(exc, openai.APITimeoutError):
        return "network failure: request timed out", None
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc
        return f"network failure: {cause}", None
    return f"{type(exc).__name__}: {exc}", None


def _read_usage(result: StreamResult, usage) -> None:
    result.prompt_tokens = getattr(usage, "prompt_tokens", None)
    result.completion_tokens = getattr(usage, "completion_tokens", None)
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    if cached is not None:
        result.cached_tokens = int(cached)
    # Server-specific usage fields (kvblend adds usage.kvblend: reused / recomputed
    # token counts) are kept.
    extra = getattr(usage, "model_extra", None) or {}
    result.extra.update({k: v for k, v in extra.items() if isinstance(k, str)})


async def stream_chat(client, model: str, request: ChatRequest) -> StreamResult:
    """Send one streaming chat completion; failures land in ``result.error`` instead of raising."""
    result = StreamResult()
    pieces: list[str] = []
    kwargs: dict = {}
    if request.include_usage:
        kwargs["stream_options"] = {"include_usage": True}
    if request.extra_body:
        kwargs["extra_body"] = request.extra_body
    t0 = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=request.messages,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            stream=True,
            **kwargs,
        )
        async for chunk in stream:
            result.chunks += 1
            if getattr(chunk, "usage", None):
                _read_usage(result, chunk.usage)
            if not chunk.choices:  # usage-only or keep-alive chunk: nothing to read
                result.empty_choice_chunks += 1
                continue
            choice = chunk.choices[0]
            content = choice.delta.content if choice.delta is not None else None
            if content:
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - t0
                pieces.append(content)
            if choice.finish_reason:
                result.finish_reason = choice.finish_reason
    except Exception as e:  # noqa: BLE001
        # every failure becomes a recorded error, benchmarks go on
        result.error, result.status_code = describe_error(e)
    result.total_s = time.perf_counter() - t0
    result.text = "".join(pieces)
    if result.error is None and result.chunks == 0:
        result.error = "stream ended without any chunk"
    return result


async def list_model_ids(client) -> list[str]:
    page = await client.models.list()
    return [m.id for m in page.data]


async def resolve_model_id(client, endpoint: Endpoint) -> str:
    """The endpoint's model_id, or the server's only model when model_id is unset."""
    if endpoint.model_id:
        return endpoint.model_id
    ids = await list_model_ids(client)
    if len(ids) != 1:
        raise ValueError(
            f"{endpoint.name}: model_id is not set and the server offers {len(ids)} models "
            f"({', '.join(ids) or 'none'}); set model_id in auth.json or KVBLEND_MODEL_ID"
        )
    return ids[0]
