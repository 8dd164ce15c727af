"""Shared pytest fixtures. Each fixture block is self-contained; add yours below,
don't edit others'."""

from __future__ import annotations

import pytest

# ---- markers: unit / engine / e2e, from what a test needs (owner: house) -------------------------
# e2e: a real server subprocess or redis-server; engine: the real model in this
# process; unit: the rest.
E2E_FIXTURES = {"kvblend_server_factory", "redis_server"}
ENGINE_MODULES = {
    "test_engine",
    "test_kernels",
    "test_qwen",
    "test_selection_oracle",
    "test_profile_prefill",
    "test_buffers",
    "test_bench_engine",
    "test_strategies",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
        elif item.module.__name__.rpartition(".")[2] in ENGINE_MODULES:
            item.add_marker(pytest.mark.engine)
        else:
            item.add_marker(pytest.mark.unit)


# ---- redis_server: a real, throwaway redis-server on a free port (owner: store) ------------------
REDIS_SKIP_REASON = "redis-server not installed"
REDIS_HINT = (
    "install it (Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis) and "
    "run make test again; .ci/run installs it"
)


def pytest_terminal_summary(terminalreporter):
    """A fresh machine without redis-server skips the shared-store tests: say so
    where people look."""
    skipped = [
        r
        for r in terminalreporter.stats.get("skipped", [])
        if REDIS_SKIP_REASON in str(getattr(r, "longrepr", ""))
    ]
    if skipped:
        terminalreporter.write_sep("=", "Redis tests skipped", yellow=True)
        terminalreporter.write_line(
            f"{len(skipped)} Redis test(s) were skipped: {REDIS_SKIP_REASON}; {REDIS_HINT}."
        )


@pytest.fixture
def redis_server():
    """A started ``LocalRedisServer`` (``.url``, ``.stop()``, ``.start()`` on the same port);
    killed after the test."""
    from kvblend.store.local_redis import LocalRedisServer

    if not LocalRedisServer.available():
        pytest.skip(REDIS_SKIP_REASON)
    server = LocalRedisServer().start()
    try:
        yield server
    finally:
        server.stop()


# ---- kvblend_server_factory: real `kvblend serve` subprocesses (owner: server) -------------------
import json as _json
import os as _os
import socket as _socket
import subprocess as _subprocess
import sys as _sys
import tempfile as _tempfile
import time as _time
from pathlib import Path as _Path

import httpx as _httpx


def _kvblend_free_port() -> int:
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KVBlendServer:
    """``python -m kvblend.cli serve`` on 127.0.0.1:<free port>; ready when /health answers 200."""

    def __init__(
        self,
        config: dict | None = None,
        args: list[str] | None = None,
        workdir: _Path | None = None,
        env: dict | None = None,
    ):
        self.port = _kvblend_free_port()
        self.extra_env = dict(env or {})
        self.workdir = _Path(workdir or _tempfile.mkdtemp(prefix="kvblend-serve-"))
        self.config = config
        self.args = list(args or [])
        self.proc: _subprocess.Popen | None = None
        self.log_path = self.workdir / "server.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> "KVBlendServer":
        cmd = [
            _sys.executable,
            "-m",
            "kvblend.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if self.config is not None:
            cfg_path = self.workdir / "server.json"  # JSON is YAML: the YAML loader reads it
            cfg_path.write_text(_json.dumps(self.config))
            cmd += ["--config", str(cfg_path)]
        env = {
            k: v
            for k, v in _os.environ.items()
            if not k.startswith(("KVBLEND_API_KEY", "KVBLEND_SERVER_API_KEY"))
        }
        env.update(self.extra_env)
        self._log = open(self.log_path, "wb")
        self.proc = _subprocess.Popen(
            cmd + self.args, stdout=self._log, stderr=_subprocess.STDOUT, env=env
        )
        deadline = _time.monotonic() + timeout
        while not self.healthy():  # poll /health (the app answers only after the models loaded)
            try:
                self.proc.wait(0.1)  # doubles as the poll interval and notices a crashed server
            except _subprocess.TimeoutExpired:
                pass
            else:
                raise RuntimeError(
                    f"kvblend serve exited with {self.proc.returncode}:\n{self.logs()}"
                )
            if _time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvblend serve not healthy after {timeout}s:\n{self.logs()}")
        return self

    def healthy(self) -> bool:
        try:
            return _httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200
        except _httpx.HTTPError:
            return False

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except _subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if getattr(self, "_log", None):
            self._log.close()


@pytest.fixture(scope="module")
def kvblend_server_factory(tmp_path_factory):
    """``start(config=None, args=None, env=None) -> KVBlendServer``; every server started is stopped
    at module end. ``env`` adds variables to the server's environment."""
    servers: list[KVBlendServer] = []

    def start(
        config: dict | None = None, args: list[str] | None = None, env: dict | None = None
    ) -> KVBlendServer:
        server = KVBlendServer(config, args, tmp_path_factory.mktemp("kvblend-serve"), env)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for s in servers:
            s.stop()
