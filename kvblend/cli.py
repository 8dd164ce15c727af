"""`kvblend` command line. Each command group lives in its own module and registers its parser here.

Command modules keep heavy imports (torch, transformers, fastapi) inside ``run`` so `kvblend --help`
stays fast; user-facing failures raise ``CLIError`` or ``ValueError`` and print as one line.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvblend import __version__
from kvblend.cli_registry import DefaultsHelpFormatter, add_command_parsers
from kvblend.platform import apply_malloc_defaults, apply_openmp_defaults

# (command, module, help). The module defines `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: list[tuple[str, str, str]] = [
    ("generate", "kvblend.engine.cli", "prefill a prompt in a chosen mode and decode (one-shot)"),
    ("bench", "kvblend.bench.cli", "benchmarks: engine, store, ttft, load, report"),
    (
        "calibrate",
        "kvblend.bench.calibrate",
        "measure blend settings against full prefill; writes the model's calibration "
        "for fidelity targets",
    ),
    (
        "eval",
        "kvblend.bench.eval_cli",
        "quality + latency evaluation through an OpenAI-style endpoint",
    ),
    ("serve", "kvblend.server.cli", "OpenAI-compatible HTTP server"),
    (
        "ingest",
        "kvblend.server.ingest_cli",
        "precompute documents from a JSONL file into the chunk store",
    ),
    ("store", "kvblend.store.cli", "inspect the chunk KV store: stats | ls | clear"),
    (
        "doctor",
        "kvblend.client.doctor",
        "diagnose an OpenAI-style endpoint configured by auth.json",
    ),
]


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvblend",
        description="CacheBlend KV reuse for RAG serving.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvblend {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_command_parsers(parser.add_subparsers(dest="command", metavar="COMMAND"), COMMANDS, "_run")
    return parser


def main(argv: list[str] | None = None) -> int:
    apply_openmp_defaults()  # before any command imports torch
    apply_malloc_defaults()  # before the model's first allocations
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (CLIError, ValueError, FileNotFoundError, PermissionError) as e:
        print(f"kvblend {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
