"""``kvblend eval``: MuSiQue / HotpotQA quality and TTFT per prefill mode, through an
OpenAI-style endpoint."""

from __future__ import annotations

import argparse

from kvblend.bench.common import add_common_arguments, exit_code_for_errors, positive_int, publish
from kvblend.client.auth import add_endpoint_arguments, endpoints_from_args

DEFAULT_MODES = "full,prefix,reuse,blend@0.15"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_endpoint_arguments(parser, multiple=True)
    add_common_arguments(parser)
    parser.set_defaults(max_tokens=32)
    parser.add_argument(
        "--limit", type=positive_int, default=20, help="examples to evaluate (first N)"
    )
    parser.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help="comma list: full, prefix, reuse, blend, blend@R, blend@R/SELECTION (deviation, "
        "query, lookahead), or default (no override)",
    )
    parser.add_argument(
        "--docs", type=positive_int, default=None, help="passages per example (default: all)"
    )
    parser.add_argument(
        "--no-shuffle",
        action="store_true",
        help="time the passages in the warm-up's order (default: shuffled, as re-ranked retrieval)",
    )
    parser.add_argument(
        "--no-prewarm",
        action="store_true",
        help="skip the untimed request that fills the chunk cache before each example's modes",
    )


def run(args: argparse.Namespace) -> int:
    from kvblend.bench.data import load_examples
    from kvblend.bench.eval import EvalConfig, run_eval, table
    from kvblend.client.stream import merge_extra_body, parse_mode_list

    cfg = EvalConfig(
        modes=parse_mode_list(args.modes),
        max_tokens=args.max_tokens,
        n_docs=args.docs,
        prewarm=not args.no_prewarm,
        extra_body=merge_extra_body(args.extra_body),
        shuffle=not args.no_shuffle,
        seed=args.seed,
    )
    endpoints = endpoints_from_args(args)
    examples = load_examples(args.data, args.limit)
    if not examples:
        raise ValueError(f"no examples in {args.data}")
    report = run_eval(endpoints, examples, cfg, str(args.data))
    from kvblend.bench.plots import plot_quality_vs_ttft

    publish(report, "eval", args.out_dir, table(report), plot_quality_vs_ttft, args.no_plot)
    return exit_code_for_errors(report, "modes")
