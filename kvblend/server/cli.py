"""`kvblend serve`: run the OpenAI-compatible server (see docs/SERVER.md)."""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="YAML or TOML server config (models, api_keys, store, host, port)"
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--model", help="serve only this model: weights dir, .gguf, or '' for the embedded model"
    )
    p.add_argument("--model-id", help="id clients send as `model` (default: the engine's id)")
    p.add_argument(
        "--dtype",
        help="auto | bfloat16 | float32 | float16 (auto: bfloat16 where native, else float32)",
    )
    p.add_argument("--threads", type=int, help="torch threads for the engine (0: torch default)")
    p.add_argument("--device", help="cpu (default), cuda or cuda:N")
    p.add_argument(
        "--mode", choices=["full", "prefix", "reuse", "blend"], help="default prefill mode"
    )
    p.add_argument("--recompute-ratio", type=float, help="default blend recompute ratio in [0, 1]")
    p.add_argument(
        "--fidelity",
        type=float,
        help="target first-token agreement with full prefill in (0, 1]: ratio and selection come "
        "from `kvblend calibrate` (full prefill where none meets it)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="accepted bearer key (repeatable); with none configured anywhere, auth is off",
    )
    p.add_argument("--max-queue", type=int, help="waiting requests per model before 429")
    p.add_argument("--max-batch", type=int, help="sequences decoded together per model")
    p.add_argument(
        "--default-max-tokens", type=int, help="completion limit when a request sets none"
    )
    p.add_argument(
        "--max-body-bytes", type=int, help="request bodies over this get 413 (default 8 MiB)"
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        dest="drain_timeout_s",
        help="seconds live requests get to finish after SIGTERM (default 30)",
    )
    p.add_argument("--log-level", default="info", help="uvicorn log level")


def _model_override(args: argparse.Namespace, base: list | None) -> list[dict] | None:
    """--model/--model-id/--dtype/... describe a single model, replacing the config's list."""
    fields = {
        "model": args.model,
        "id": args.model_id,
        "dtype": args.dtype,
        "device": args.device,
        "num_threads": args.threads,
        "mode": args.mode,
        "recompute_ratio": args.recompute_ratio,
        "fidelity": args.fidelity,
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    if not fields:
        return None
    if args.model is None and base:  # flags tweak every configured model
        return [{**m.settings(), **fields} for m in base]
    return [fields]


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket before any weights load, so a busy port fails in a second, not
    after the model is up. Port 0 picks a free one (the summary prints it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"port {port} on {host} is already in use (another server?); "
                "choose another with --port"
            ) from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(args: argparse.Namespace) -> int:
    from kvblend.settings import load_server_config

    base = load_server_config(args.config)
    overrides = {
        "host": args.host,
        "port": args.port,
        "max_queue": args.max_queue,
        "max_batch": args.max_batch,
        "default_max_tokens": args.default_max_tokens,
        "max_body_bytes": args.max_body_bytes,
        "drain_timeout_s": args.drain_timeout_s,
        "models": _model_override(args, base.models),
    }
    if args.api_key:
        overrides["api_keys"] = [
            {"key": k, "name": f"cli{i}"} for i, k in enumerate(args.api_key)
        ] + [{"key": k.key, "name": k.name, "namespace": k.namespace} for k in base.api_keys]
    config = load_server_config(args.config, overrides)
    if not config.api_keys and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "serving on %s with no API keys: anyone who can reach it can use it", config.host
        )
    sock = bind_socket(
        config.host, config.port
    )  # before the heavy imports: a busy port fails at once
    from kvblend.server.app import create_app
    from kvblend.server.shutdown import serve
    from kvblend.server.summary import startup_summary

    def on_ready(backends) -> None:
        print(startup_summary(config, backends, _url(sock)), file=sys.stderr, flush=True)

    app = create_app(config, on_ready=on_ready)
    serve(app, config, args.log_level, sockets=[sock])  # SIGTERM drains live requests first
    return 0
