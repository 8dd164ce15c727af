"""The one worker thread that owns an engine: admits queued requests, batches their decode steps.

The engine is not thread-safe, so everything that touches it (tokenizing, prefill, decode,
precompute) runs here. Callers ``submit`` a job plus a ``sink`` callback; the worker calls the sink
with ``Started(stats)``, then ``TokenEvent``s, then one ``GenerationResult`` — or a single
``Failed``. The sink runs on the worker thread, so it must only hand the event off (the server uses
``loop.call_soon_threadsafe``); a slow consumer therefore never stalls other requests.

Scheduling policy: each loop admits waiting requests (prefill, one at a time) until ``max_batch``
sequences are active, then runs one batched ``engine.step`` over all active sequences. Admission
beyond ``max_queue`` waiting jobs is refused with ``QueueFullError`` so overload surfaces as a fast
429 instead of unbounded latency.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from kvblend.engine.request import GenerationRequest, GenerationResult, PrefillStats, TokenEvent

log = logging.getLogger(__name__)

# Called on the worker thread when a callable is given; the server builds requests on a helper
# thread instead (kvblend/server/backends.py) so tokenizing a large prompt never holds the worker.
RequestBuilder = Callable[[Any], GenerationRequest]
# Deferred chunk work (missing chunks computed after a request's first token) runs a few layers
# at a time between the worker's turns: while sequences decode, for at most this share of the last
# decoding step's time, so a stream slows by about that share instead of stalling for whole
# chunks; when idle, in slices of IDLE_SLICE_S, so a request that arrives meanwhile waits one
# slice, not every chunk.
DEFERRED_SHARE = 0.5
IDLE_SLICE_S = 0.05


@dataclass
class Started:
    """Prefill finished; ``stats`` is final for the prompt side (ttft_ms, cached tokens, ...)."""

    stats: PrefillStats


@dataclass
class Failed:
    error: BaseException


Event = Union[Started, TokenEvent, GenerationResult, Failed]
Sink = Callable[[Event], None]


class QueueFullError(RuntimeError):
    def __init__(self, depth: int, retry_after_s: int):
        super().__init__(
            f"the request queue is full ({depth} waiting); retry after {retry_after_s}s"
        )
        self.depth = depth
        self.retry_after_s = retry_after_s


class SchedulerClosedError(RuntimeError):
    """The worker is stopped (shutting down, or it died): the request was not run."""


class Handle:
    """A caller's grip on a submitted request: ``cancel()`` is safe from any thread, any time."""

    def __init__(self, build: RequestBuilder | GenerationRequest, sink: Sink):
        self.build = build
        self.sink = sink
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class _Active:
    handle: Handle
    seq: Any


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


class Scheduler:
    def __init__(
        self,
        engine,
        max_queue: int = 64,
        max_batch: int = 8,
        retry_after_s: int = 1,
        name: str = "engine",
    ):
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.retry_after_s = retry_after_s
        self.name = name
        self._pending: collections.deque[Handle | _Call] = collections.deque()
        self._active: list[_Active] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # batched decode steps run (for metrics / tests)
        self._last_step_s = (
            0.0  # the last decoding step's time: deferred work's budget scales with it
        )
        self.max_batch_seen = 0

    # --- caller side (any thread) --------------------------------------------------------------

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(
            target=self._run, name=f"kvblend-worker-{self.name}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def active_count(self) -> int:
        return len(self._active)

    def submit(self, build: RequestBuilder | GenerationRequest, sink: Sink) -> Handle:
        handle = Handle(build, sink)
        self._enqueue(handle)
        return handle

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the worker thread (e.g. precompute); bounded like requests."""
        item = _Call(fn, concurrent.futures.Future())
        self._enqueue(item)
        return item.future

    def _enqueue(self, item: Handle | _Call) -> None:
        with self._cond:
            if not self.alive:
                raise SchedulerClosedError(f"the {self.name} worker is not running")
            if len(self._pending) >= self.max_queue:
                raise QueueFullError(len(self._pending), self.retry_after_s)
            self._pending.append(item)
            self._cond.notify()

    # --- worker side ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while (
                        not self._stopping
                        and not self._pending
                        and not self._active
                        and not self._has_deferred()
                    ):
                        if self._has_shadow():
                            break
                        self._cond.wait()
                    if self._stopping:
                        break
                    idle = not self._pending and not self._active
                if idle and not self._has_deferred():  # nothing to serve: check a sampled blend
                    self._run_shadow()
                    continue
                self._admit()
                self._step()
                self._run_deferred()  # what prefills left: a slice a turn while others decode
        except (
            BaseException
        ) as e:  # a bug in the engine loop: fail everyone loudly, not silently hang
            log.exception("scheduler %s died", self.name)
            self._fail_all(e)
            raise
        finally:
            self._fail_all(SchedulerClosedError("the server is shutting down"))

    def _next_pending(self) -> Handle | _Call | None:
        with self._cond:
            return self._pending.popleft() if self._pending else None

    def _has_deferred(self) -> bool:
        return bool(getattr(self.engine, "has_deferred", False))

    def _has_shadow(self) -> bool:
        return bool(getattr(self.engine, "has_shadow", False))

    def _run_shadow(self) -> None:
        """One shadow full prefill (fidelity targets): only while idle, so it costs no request its
        TTFT unless one arrives during it (it then waits at most one full prefill)."""
        try:
            self.engine.run_shadow()
        except Exception:  # a failed check only costs a sample
            log.exception("shadow full prefill failed")

    def _run_deferred(self) -> None:
        """Chunk KV a request found missing, computed from right after its first token went out
        (off its TTFT) in time slices (DEFERRED_SHARE, IDLE_SLICE_S): the worker turns between
        them admit new requests and step live streams."""
        if self._has_deferred():
            budget = DEFERRED_SHARE * self._last_step_s if self._active else IDLE_SLICE_S
            try:
                self.engine.run_deferred(budget)
            except Exception:  # a failed precompute only costs a later cache miss
                log.exception("deferred chunk precompute failed")

    def _admit(self) -> None:
        # Calls (precompute) run in queue order, interleaved with prefills; they never wait for a
        # free slot.
        while len(self._active) < self.max_batch:
            item = self._next_pending()
            if item is None:
                return
            if isinstance(item, _Call):
                self._run_call(item)
                continue
            if item.cancelled.is_set():
                continue  # client went away while queued: never prefill it
            self._prefill(item)

    def _run_call(self, call: _Call) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        try:
            call.future.set_result(call.fn(self.engine))
        except Exception as e:
            call.future.set_exception(e)

    def _prefill(self, handle: Handle) -> None:
        try:
            req = handle.build(self.engine) if callable(handle.build) else handle.build
            seq = self.engine.start(req)
        except (
            Exception
        ) as e:  # bad input (ValueError, ContextLengthError) or an engine bug: this request only
            _emit(handle, Failed(e))
            return
        _emit(handle, Started(seq.stats))
        # start() already sampled the first token: hand it out now rather than after the next batch
        # step, which would add the prefills of every request admitted in between to this request's
        # TTFT.
        pending = getattr(seq, "pending", None)
        while pending:
            _emit(handle, pending.pop(0))
        if _done(seq):
            _emit(handle, seq.result())
        else:
            self._active.append(_Active(handle, seq))
        self._run_deferred()

    def _step(self) -> None:
        self._active = [a for a in self._active if not a.handle.cancelled.is_set()]
        if not self._active:
            return
        batch = list(self._active)
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        try:
            started = time.perf_counter()
            events = self.engine.step([a.seq for a in batch])
            self._last_step_s = time.perf_counter() - started
        except Exception as e:  # one broken batch must not take the server down
            log.exception("engine.step failed for %d sequences", len(batch))
            for a in batch:
                _emit(a.handle, Failed(e))
            self._active = []
            return
        self.steps += 1
        still: list[_Active] = []
        for a, ev in zip(batch, events):
            if ev is not None:
                _emit(a.handle, ev)
            if _done(a.seq):
                _emit(a.handle, a.seq.result())
            else:
                still.append(a)
        self._active = still

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
            active, self._active = self._active, []
            self._stopping = True
        for a in active:
            _emit(a.handle, Failed(error))
        for item in pending:
            if isinstance(item, _Call):
                if item.future.set_running_or_notify_cancel():
                    item.future.set_exception(error)
            else:
                _emit(item, Failed(error))


def _done(seq) -> bool:
    """Finished and every event handed out (``pending``: events produced by ``start``, see
    Engine.step)."""
    return bool(seq.finished) and not getattr(seq, "pending", None)


def _emit(handle: Handle, event: Event) -> None:
    try:
        handle.sink(event)
    except (
        Exception
    ):  # e.g. the consumer's event loop is closed; the worker must keep serving others
        log.debug("dropping an event for a gone consumer", exc_info=True)
