"""`kvblend bench <what>`: each benchmark module provides add_arguments(parser) and run(args)."""

from __future__ import annotations

import argparse

from kvblend.cli_registry import add_command_parsers

BENCHES = [
    (
        "engine",
        "kvblend.bench.engine_bench",
        "in-process TTFT + quality of full / prefix / reuse / blend on MuSiQue",
    ),
    ("store", "kvblend.bench.store_bench", "chunk KV load bandwidth per store tier vs memcpy"),
    (
        "ttft",
        "kvblend.bench.ttft",
        "TTFT of an OpenAI-style endpoint: prefix hit / shuffled chunks / full recompute",
    ),
    ("load", "kvblend.bench.load", "open-loop request rates against a server: throughput and TTFT"),
    (
        "report",
        "kvblend.bench.report",
        "docs/benchmarks.md and the README's headline from bench/results",
    ),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_command_parsers(parser.add_subparsers(dest="bench", metavar="BENCH"), BENCHES, "_bench_run")


def run(args) -> int:
    if not getattr(args, "_bench_run", None):
        raise ValueError(
            "choose a benchmark: engine, store, ttft, load or report (see kvblend bench --help)"
        )
    return args._bench_run(args)
