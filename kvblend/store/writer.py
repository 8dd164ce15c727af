"""The one background writer thread that slow tiers (disk, redis) hand their writes to.

Requests never wait on it: ``submit`` only enqueues. Pending work is bounded by bytes; past the
bound a write is dropped and counted (a cache write is an optimisation, losing one is harmless,
stalling a request or growing memory without bound is not).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class BackgroundWriter:
    """FIFO of zero-argument jobs run on one daemon thread; exceptions are logged and counted."""

    def __init__(self, max_pending_bytes: int = 1 << 30, name: str = "kvblend-store-writer"):
        self.max_pending_bytes = max_pending_bytes
        self._q: queue.Queue[tuple[Callable[[], None], int] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending_jobs = 0
        self._pending_bytes = 0
        self.done = self.dropped = self.failed = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], nbytes: int = 0) -> bool:
        """Queue ``job``; False (and counted as dropped) if closed or over the
        pending-bytes bound."""
        with self._lock:
            if self._closed or (
                self._pending_jobs and self._pending_bytes + nbytes > self.max_pending_bytes
            ):
                self.dropped += 1
                return False
            self._pending_jobs += 1
            self._pending_bytes += nbytes
        self._q.put((job, nbytes))
        return True

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            job, nbytes = item
            try:
                job()
                ok = True
            except Exception:  # a failed cache write must not kill the writer
                log.exception("background store write failed")
                ok = False
            with self._lock:
                self._pending_jobs -= 1
                self._pending_bytes -= nbytes
                self.done += ok
                self.failed += not ok
                if self._pending_jobs == 0:
                    self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every queued job ran; True if the queue drained within ``timeout``."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending_jobs == 0, timeout)

    def stats(self) -> dict:
        with self._lock:
            return {
                "pending": self._pending_jobs,
                "pending_bytes": self._pending_bytes,
                "done": self.done,
                "dropped": self.dropped,
                "failed": self.failed,
            }

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish queued jobs (up to ``timeout``), then stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._q.put(None)
        self._thread.join(timeout)
