"""What a model id resolves to: a ``Backend`` with one interface, whatever serves the tokens.

The HTTP layer turns an OpenAI (or, later, Anthropic) request into a wire-neutral ``GenerationJob``
and consumes ``Delta`` / ``Final`` events; it never touches an engine. ``LocalBackend`` runs an
in-process engine behind a ``Scheduler`` worker thread; an upstream (remote OpenAI-compatible)
backend only has to implement the same ``open`` / ``precompute`` / lifecycle methods.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

from kvblend.blend.segmenter import (
    build_completion_segments,
    build_segments_from_messages,
    canonical_chunk,
)
from kvblend.config import ModelEntry, ServerConfig
from kvblend.engine.request import (
    ContextLengthError,
    GenerationRequest,
    GenerationResult,
    PrefillStats,
    SamplingParams,
    TokenEvent,
)
from kvblend.engine.scheduler import (
    Failed,
    QueueFullError,
    Scheduler,
    SchedulerClosedError,
    Started,
)
from kvblend.policy import PrefillPolicy
from kvblend.server import errors
from kvblend.server.limits import check_chunk_sizes, check_num_documents, check_token_ids
from kvblend.server.logprobs import token_entry

log = logging.getLogger(__name__)


@dataclass
class GenerationJob:
    """A generation request independent of the API it arrived through."""

    messages: list[dict] | None = None  # chat: OpenAI-style messages (text only)
    prompt: str | list[int] | None = None  # completions: raw prompt text or token ids
    documents: list[str] = field(default_factory=list)
    max_tokens: int | None = None  # None: the server default, capped by the free context
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    mode: str | None = None
    recompute_ratio: float | None = None
    selection: str | None = None
    fidelity: float | None = None  # target first-token agreement (kvblend/engine/fidelity.py)
    namespace: str = ""
    logprobs: int | None = None  # None: off; k: each token's logprob and the top k alternatives
    queue_s: float | None = None  # set by LocalBackend.open: waited for the worker before prefill


@dataclass
class Delta:
    text: str
    logprobs: list[dict] | None = None  # chat-format entries of the tokens behind ``text``


@dataclass
class Final:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str  # the whole completion (non-streaming responses use it)
    kvblend: dict[str, Any] | None = None  # PrefillStats.as_dict()
    logprobs: list[dict] | None = None  # every token's entry (non-streaming responses use it)


BackendEvent = Union[Delta, Final]


class GenerationStream(Protocol):
    def events(self) -> AsyncIterator[BackendEvent]: ...
    def cancel(self) -> None: ...


class Backend(Protocol):
    id: str
    created: int
    owned_by: str

    def start(self) -> None: ...  # blocking (loads weights); called once, off the event loop
    def close(self) -> None: ...
    def queue_depth(self) -> int: ...
    def active(self) -> int: ...  # sequences being generated now
    async def open(
        self, job: GenerationJob
    ) -> GenerationStream: ...  # raises APIError before any output
    async def precompute(self, documents: list[str], namespace: str) -> list[dict]: ...


# --- local engine --------------------------------------------------------------------------------


def build_request(
    engine, job: GenerationJob, default_max_tokens: int, max_documents: int = 1 << 30
) -> GenerationRequest:
    """Tokenizes, checks the context window and chunk count, fixes max_tokens. Runs on a helper
    thread, not the model's worker: only the tokenizer is touched (its fast encode is safe across
    threads), so a huge prompt's tokenization never stalls other tenants' decode steps."""
    if job.messages is not None:
        segs = build_segments_from_messages(
            engine.tokenizer, job.messages, documents=job.documents or None
        )
    else:
        segs = build_completion_segments(
            engine.tokenizer, job.prompt if job.prompt is not None else "", job.documents
        )
    check_num_documents(len(segs.chunk_ids), max_documents)
    n, limit = segs.num_tokens, int(engine.max_context_len)
    if n >= limit:
        raise ContextLengthError(n, limit)
    if job.max_tokens is not None and n + job.max_tokens > limit:
        raise ContextLengthError(n, limit, job.max_tokens)
    max_tokens = job.max_tokens or max(1, min(default_max_tokens, limit - n))
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=job.temperature,
        top_p=job.top_p,
        stop=list(job.stop),
        seed=job.seed,
        logprobs=job.logprobs,
    )
    policy = PrefillPolicy.from_fields(
        job.mode, job.recompute_ratio, job.selection
    )  # "lookahead:8"
    return GenerationRequest(segs, sampling, policy, namespace=job.namespace, fidelity=job.fidelity)


def map_engine_error(e: BaseException) -> errors.APIError:
    """Engine exceptions -> OpenAI errors."""
    if isinstance(e, errors.APIError):
        return e
    if isinstance(e, ContextLengthError):
        requested = e.requested
        if requested:
            return errors.invalid_request(
                f"This model's maximum context length is {e.max_context_len} tokens. "
                f"However, you requested {e.prompt_tokens + requested} tokens "
                f"({e.prompt_tokens} in the messages, {requested} in the completion). "
                "Please reduce the length of the messages or completion.",
                "messages",
                "context_length_exceeded",
            )
        return errors.context_length_exceeded(int(e.prompt_tokens), int(e.max_context_len))
    if isinstance(e, SchedulerClosedError):
        return errors.unavailable(str(e))
    if isinstance(
        e, ValueError
    ):  # the engine's contract: ValueError = bad input, message names the limit
        return errors.invalid_request(str(e))
    log.error("generation failed", exc_info=e)
    return errors.internal_error()


class LocalStream:
    """Consumes one request's events from the worker through an asyncio queue on the server's
    loop."""

    def __init__(self, handle, queue: asyncio.Queue, stats: PrefillStats, decode=None):
        self._handle = handle
        self._queue = queue
        self.stats = stats
        self._decode = decode  # token id -> text, for logprobs entries
        self.num_tokens = 0  # tokens received so far: usage of a stream the client cut short
        self.warning: str | None = None  # set by the server (reuse_warning): into Final.kvblend

    def cancel(self) -> None:
        self._handle.cancel()

    async def events(self) -> AsyncIterator[BackendEvent]:
        streamed: list[str] = []
        entries: list[dict] | None = None  # logprobs of every token; ``pending`` not yet sent
        pending: list[dict] = []
        try:
            while True:
                ev = await self._queue.get()
                if isinstance(ev, TokenEvent):
                    self.num_tokens += 1
                    if ev.logprob is not None and self._decode is not None:
                        entry = token_entry(self._decode, ev.token_id, ev.logprob, ev.top_logprobs)
                        entries = (entries or []) + [entry]
                        pending.append(entry)
                    if ev.text:
                        streamed.append(ev.text)
                        yield Delta(ev.text, pending if entries is not None else None)
                        pending = []
                elif isinstance(ev, GenerationResult):
                    # If the engine settled text differently than it streamed (e.g. held-back stop
                    # text), send what the client has not seen yet so stream and non-stream agree.
                    sent = "".join(streamed)
                    if ev.text.startswith(sent) and len(ev.text) > len(sent):
                        yield Delta(ev.text[len(sent) :], pending if entries is not None else None)
                    final = _final(ev)
                    final.logprobs = entries
                    if self.warning and final.kvblend is not None:
                        final.kvblend["warning"] = self.warning
                    yield final
                    return
                elif isinstance(ev, Failed):
                    raise map_engine_error(ev.error)
        finally:
            # no-op when finished; frees the sequence when the consumer left early
            self._handle.cancel()


def _final(result: GenerationResult) -> Final:
    s = result.stats
    return Final(
        result.finish_reason,
        s.prompt_tokens,
        len(result.token_ids),
        s.cached_tokens,
        result.text,
        s.as_dict(),
    )


class LocalBackend:
    owned_by = "kvblend"

    def __init__(self, entry: ModelEntry, store, config: ServerConfig, engine=None):
        self.entry = entry
        self.store = store
        self.config = config
        self.id = entry.id
        self.created = int(time.time())
        self.engine = (
            engine  # given: tests' stand-in engines; None: built from ``entry`` in start()
        )
        self.scheduler: Scheduler | None = None

    def start(self) -> None:
        if self.engine is None:
            from kvblend.engine.engine import (
                create_engine,
            )  # heavy (torch); imported when serving only

            self.engine = create_engine(self.entry.engine_config(), self.store)
        self.id = self.entry.id or self.engine.model_id
        self.scheduler = Scheduler(
            self.engine,
            self.config.max_queue,
            self.config.max_batch,
            self.config.retry_after_s,
            name=self.id,
        ).start()

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()

    def fidelity_stats(self) -> dict | None:
        """Agreement with full prefill: the calibrated estimate for the configured target's setting
        and the shadow-measured live one (None for stand-in engines without a fidelity
        controller)."""
        controller = getattr(self.engine, "fidelity", None)
        if controller is None:
            return None
        live = controller.live_agreement()
        target = self.engine.config.blend.fidelity
        return {
            "calibrated": controller.calibrated_agreement(target) if target is not None else None,
            "live": live[0] if live else None,
            "live_n": live[1] if live else 0,
        }

    def queue_depth(self) -> int:
        return self.scheduler.queue_depth if self.scheduler else 0

    def active(self) -> int:
        return self.scheduler.active_count if self.scheduler else 0

    def _scheduler(self) -> Scheduler:
        if self.scheduler is None or not self.scheduler.alive:
            raise errors.unavailable(f"model {self.id!r} is not running", self.config.retry_after_s)
        return self.scheduler

    async def open(self, job: GenerationJob) -> LocalStream:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(ev) -> None:  # worker thread -> this request's queue, never blocking the worker
            loop.call_soon_threadsafe(queue.put_nowait, ev)

        engine, config = self.engine, self.config
        check_num_documents(len(job.documents), config.max_documents)
        check_token_ids(job.prompt, getattr(engine, "vocab_size", None))
        scheduler = self._scheduler()
        try:
            req = await asyncio.to_thread(
                build_request, engine, job, config.default_max_tokens, config.max_documents
            )
        except errors.APIError:
            raise
        except Exception as e:
            raise map_engine_error(e) from None
        try:
            handle = scheduler.submit(req, sink)
        except QueueFullError as e:
            raise errors.queue_full(e.retry_after_s, e.depth) from None
        except SchedulerClosedError as e:
            raise errors.unavailable(str(e), self.config.retry_after_s) from None
        try:
            first = await queue.get()  # prefill outcome: errors surface before any byte is sent
        except BaseException:
            handle.cancel()  # client disconnected while queued
            raise
        if isinstance(first, Failed):
            raise map_engine_error(first.error)
        assert isinstance(first, Started), first
        # submitted -> Started, less the engine's own prefill time: the wait for the worker
        waited = time.perf_counter() - handle.submitted_at - first.stats.ttft_ms / 1000
        job.queue_s = max(0.0, waited)
        decode = self.engine.tokenizer.decode if job.logprobs is not None else None
        return LocalStream(handle, queue, first.stats, decode)

    async def precompute(self, documents: list[str], namespace: str) -> list[dict]:
        """Tokenized on a helper thread; computed on the worker a slice at a time, so other
        requests' steps run between slices. Cancelling the caller stops before the next slice."""
        check_num_documents(len(documents), self.config.max_documents)
        check_not_blank(documents)
        engine = self.engine
        try:
            ids = await asyncio.to_thread(
                lambda: [
                    engine.segments(documents=[d], question="").chunk_ids[0] for d in documents
                ]
            )
        except Exception as e:
            raise map_engine_error(e) from None
        check_chunk_sizes(ids, getattr(engine, "max_chunk_tokens", lambda: None)())
        out: list[dict] = []
        step = self.config.precompute_slice
        for i in range(0, len(ids), step):
            part = ids[i : i + step]
            try:
                fut = self._scheduler().call(
                    lambda e, part=part: list(e.precompute(part, namespace=namespace))
                )
            except QueueFullError as e:
                raise errors.queue_full(e.retry_after_s, e.depth) from None
            except SchedulerClosedError as e:
                raise errors.unavailable(str(e), self.config.retry_after_s) from None
            try:
                out += await asyncio.wrap_future(fut)
            except errors.APIError:
                raise
            except Exception as e:
                raise map_engine_error(e) from None
        return out


def check_not_blank(documents: list[str]) -> None:
    """400 for a document of whitespace only: it has no chunk to cache (schemathesis found the
    500 it used to be)."""
    for i, text in enumerate(documents):
        if not canonical_chunk(text):
            raise errors.invalid_request(
                f"documents[{i}] is blank: a document to cache needs text",
                f"documents[{i}]",
                "empty_document",
            )


def document_id(text: str) -> str:
    return "doc-" + hashlib.sha256(text.encode()).hexdigest()[:24]
