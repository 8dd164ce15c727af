"""Pieces every client benchmark shares: common flags, result files, Markdown
tables, progress bars."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

DEFAULT_OUT_DIR = Path("bench/results")


def add_common_arguments(parser: argparse.ArgumentParser, data_default: str = "musique") -> None:
    parser.add_argument(
        "--data",
        default=data_default,
        help="musique | hotpotqa | path to a MuSiQue-shaped .json or a .jsonl file",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument(
        "--extra-body",
        type=parse_json_object,
        default=None,
        metavar="JSON",
        help='extra request fields passed through as-is, e.g. \'{"mode": "blend"}\'',
    )
    parser.add_argument(
        "--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where the JSON and PNG go"
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--seed", type=int, default=0)


def parse_json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def utc_stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def result_paths(out_dir: Path, kind: str) -> tuple[Path, Path]:
    """(json, png) paths for one run; the timestamp keeps earlier runs."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{kind}-{utc_stamp()}"
    return out_dir / f"{stem}.json", out_dir / f"{stem}.png"


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")


def publish(report: dict, kind: str, out_dir: Path, table_text: str, plot, no_plot: bool) -> None:
    """Write ``report`` as JSON, print its Markdown table, and draw its PNG with
    ``plot(report, path)``."""
    json_path, png_path = result_paths(out_dir, kind)
    write_json(report, json_path)
    print(table_text)
    print(f"wrote {json_path}", file=sys.stderr)
    if not no_plot:
        plot(report, png_path)
        print(f"wrote {png_path}", file=sys.stderr)


def exit_code_for_errors(report: dict, section: str) -> int:
    """Print one stderr line per endpoint/``section`` entry that had errors; 1
    if any did, else 0."""
    failed = [
        f"{ep['endpoint']['name']}/{name}: {entry['first_error']}"
        for ep in report["endpoints"]
        for name, entry in ep[section].items()
        if entry["errors"]
    ]
    for line in failed:
        print(f"errors in {line}", file=sys.stderr)
    return 1 if failed else 0


def client_machine() -> str:
    """The machine the client benchmark ran on (the server's, when it serves on loopback)."""
    from kvblend.platform import cpu_model_name

    return f"{cpu_model_name() or platform.machine()}, {os.cpu_count()} CPUs"


def report_header(kind: str, config: dict) -> dict:
    return {
        "kind": kind,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "unix_time": time.time(),
        "machine": client_machine(),
        "config": config,
    }


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def make_progress():
    """A rich progress bar on stderr (stdout carries the table); plain when stderr
    is not a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=sys.stderr)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
