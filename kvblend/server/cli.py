"""`kvblend serve`: run the OpenAI-compatible server (see docs/SERVER.md)."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML or TOML server config (models, api_keys, store, host, port)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--model", help="serve only this model: weights dir, .gguf, or '' for the embedded model")
    p.add_argument("--model-id", help="id clients send as `model` (default: the engine's id)")
    p.add_argument("--dtype", help="auto | bfloat16 | float32 | float16 (auto: bfloat16 where native, else float32)")
    p.add_argument("--threads", type=int, help="torch threads for the engine (0: torch default)")
    p.add_argument("--device", help="cpu (default), cuda or cuda:N")
    p.add_argument("--mode", choices=["full", "prefix", "reuse", "blend"], help="default prefill mode")
    p.add_argument("--recompute-ratio", type=float, help="default blend recompute ratio in [0, 1]")
    p.add_argument("--fidelity", type=float,
                   help="target first-token agreement with full prefill in (0, 1]: ratio and selection come "
                        "from `kvblend calibrate` (full prefill where none meets it)")
    p.add_argument("--api-key", action="append", default=None,
                   help="accepted bearer key (repeatable); with none configured anywhere, auth is off")
    p.add_argument("--max-queue", type=int, help="waiting requests per model before 429")
    p.add_argument("--max-batch", type=int, help="sequences decoded together per model")
    p.add_argument("--default-max-tokens", type=int, help="completion limit when a request sets none")
    p.add_argument("--log-level", default="info", help="uvicorn log level")


def _model_override(args: argparse.Namespace, base: list | None) -> list[dict] | None:
    """--model/--model-id/--dtype/... describe a single model, replacing the config's list."""
    fields = {"model": args.model, "id": args.model_id, "dtype": args.dtype, "device": args.device,
              "num_threads": args.threads, "mode": args.mode, "recompute_ratio": args.recompute_ratio,
              "fidelity": args.fidelity}
    fields = {k: v for k, v in fields.items() if v is not None}
    if not fields:
        return None
    if args.model is None and base:  # flags tweak every configured model
        import dataclasses
        return [{**dataclasses.asdict(m), **fields} for m in base]
    return [fields]


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvblend.server.app import create_app
    from kvblend.server.settings import load_server_config

    base = load_server_config(args.config)
    overrides = {"host": args.host, "port": args.port, "max_queue": args.max_queue, "max_batch": args.max_batch,
                 "default_max_tokens": args.default_max_tokens,
                 "models": _model_override(args, base.models)}
    if args.api_key:
        overrides["api_keys"] = [{"key": k, "name": f"cli{i}"} for i, k in enumerate(args.api_key)] + [
            {"key": k.key, "name": k.name, "namespace": k.namespace} for k in base.api_keys]
    config = load_server_config(args.config, overrides)
    if not config.api_keys and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s with no API keys: anyone who can reach it can use it", config.host)
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
