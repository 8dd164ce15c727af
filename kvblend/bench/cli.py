"""`kvblend bench <what>`: each benchmark module provides add_arguments(parser) and run(args)."""

from __future__ import annotations

import argparse
import importlib

BENCHES = [
    ("engine", "kvblend.bench.engine_bench", "in-process TTFT + quality of full / prefix / reuse / blend on MuSiQue"),
    ("store", "kvblend.bench.store_bench", "chunk KV load bandwidth per store tier vs memcpy"),
    ("ttft", "kvblend.bench.ttft", "TTFT of an OpenAI-style endpoint: prefix hit / shuffled chunks / full recompute"),
    ("load", "kvblend.bench.load", "open-loop request rates against a server: throughput and TTFT"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    for name, module, help_text in BENCHES:
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("kvblend"):
                continue
            raise
        mod.add_arguments(p)
        p.set_defaults(_bench_run=mod.run)


def run(args) -> int:
    if not getattr(args, "_bench_run", None):
        raise ValueError("choose a benchmark: engine, store, ttft or load (see kvblend bench --help)")
    return args._bench_run(args)
