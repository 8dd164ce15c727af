"""Start a throwaway local ``redis-server`` (tests and benchmarks; never used when serving)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedisServer:
    """``redis-server`` on 127.0.0.1:<port>, no persistence. ``stop`` kills it (-9, like a crash);
    ``start`` again reuses the port, so callers can take the server away and bring it back."""

    def __init__(self, port: int | None = None, executable: str = "redis-server"):
        self.port = port or free_port()
        self.executable = executable
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def available(executable: str = "redis-server") -> bool:
        return shutil.which(executable) is not None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "LocalRedisServer":
        """Spawn and return once it answers PING (polled; no guessed sleep). Raises RuntimeError."""
        self.proc = subprocess.Popen(
            [
                self.executable,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port}")
            time.sleep(0.01)
        return self

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> "LocalRedisServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
