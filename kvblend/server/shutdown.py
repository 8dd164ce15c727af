"""Graceful shutdown for ``kvblend serve``: drain, end what is left with an error event, then exit.

On the first SIGTERM (or SIGINT) the server keeps listening but admits nothing new: the gate answers
every ``/v1/`` request 503 in the endpoint's own error shape with ``Retry-After``, and ``/health``
answers 503 so a load balancer takes the replica out. Live requests, streams included, get up to
``drain_timeout_s`` to finish normally (``[DONE]`` / ``message_stop``). Whatever is still running
then is ended by stopping the backends: a local model's worker fails its sequences with "the server
is shutting down", which each stream reports in-band as an error event (OpenAI: ``data: {"error":
...}``, Anthropic: ``event: error``), and upstream relays end with an error event too. Only then
does uvicorn run its own shutdown. A second signal skips the drain.

uvicorn alone cancels every request task after ``timeout_graceful_shutdown`` and before the app's
shutdown runs, so streams were cut with no closing event at all.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

log = logging.getLogger(__name__)

END_GRACE_S = 3.0  # after the backends stop: time for the error events to reach clients


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state, drain_timeout_s: float):
        super().__init__(config)
        self.app_state = state
        self.drain_timeout_s = drain_timeout_s
        self._deadline: float | None = None
        self._ended = False

    def handle_exit(self, sig: int, frame) -> None:
        first = self._deadline is None and not self.should_exit
        if first and sig in (signal.SIGTERM, signal.SIGINT):
            self._captured_signals.append(sig)  # re-raised by uvicorn once it has shut down
            self.app_state.lifecycle.draining = True
            self._deadline = time.monotonic() + self.drain_timeout_s
            log.info(
                "shutdown requested: draining %d request(s) for up to %gs",
                self.app_state.lifecycle.inflight,
                self.drain_timeout_s,
            )
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._deadline is not None and not self.should_exit:
            if self.app_state.lifecycle.inflight == 0:
                self.should_exit = True
            elif time.monotonic() >= self._deadline:
                if self._ended:
                    self.should_exit = True
                else:
                    self._ended = True
                    self._deadline = time.monotonic() + END_GRACE_S
                    log.warning(
                        "drain timeout: ending %d request(s) with an error event",
                        self.app_state.lifecycle.inflight,
                    )
                    await asyncio.to_thread(_stop_backends, self.app_state)
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        # However the drain ended (a second signal included), generations end with an error event
        # before uvicorn's own shutdown, which would cancel their tasks with no closing event.
        if not self._ended:
            self._ended = True
            await asyncio.to_thread(_stop_backends, self.app_state)
        await super().shutdown(sockets)


def _stop_backends(state) -> None:
    for backend in state.backends:
        try:
            backend.close()
        except Exception:
            log.exception("stopping backend %s failed", getattr(backend, "id", "?"))


def serve(app, config, log_level: str = "info", sockets: list | None = None) -> None:
    """``uvicorn.run`` with the drain above (``config`` is the ServerConfig); ``sockets``: already
    bound listening sockets (the CLI binds before loading weights)."""
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        timeout_graceful_shutdown=int(END_GRACE_S) + 2,
    )
    DrainingServer(uv_config, app.state.kvblend, config.drain_timeout_s).run(sockets=sockets)
