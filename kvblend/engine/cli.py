"""`kvblend generate`: prefill one prompt in a chosen mode and decode it (documents as chunks)."""

from __future__ import annotations

import argparse
import json

from kvblend.cli_registry import add_model_arguments
from kvblend.policy import PrefillPolicy, parse_selection


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--doc", action="append", default=[], help="a document (chunk); repeatable")
    p.add_argument(
        "--docs-file", help='a JSONL file of documents ({"text": ...} per line) or plain lines'
    )
    p.add_argument("--question", required=True, help="the question (query segment)")
    p.add_argument(
        "--instruction", default="", help="text after the template start, before the documents"
    )
    add_model_arguments(p)
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--mode", default="blend", choices=["full", "prefix", "reuse", "blend"])
    p.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="blend recompute ratio in [0, 1] (default: the selection's; auto: the model family's)",
    )
    p.add_argument(
        "--fidelity",
        type=float,
        default=None,
        help="target first-token agreement with full prefill in (0, 1]: ratio and selection from "
        "`kvblend calibrate` (full prefill where none meets it); excludes --ratio/--selection",
    )
    p.add_argument(
        "--selection",
        default=None,
        type=_selection,
        help="which chunk tokens blend recomputes: "
        "deviation (largest KV deviation at the check layer) "
        "or lookahead (most attended by the query over all layers of a reuse pass run first; "
        "lookahead:N over its first N); experimental, dominated by lookahead: query (most attended "
        "by the query at the check layer), or auto (the model family's measured best; default)",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print the text and prefill stats as JSON")


def _selection(text: str) -> str:
    """--selection, checked here so argparse prints the error on one line."""
    try:
        parse_selection(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _read_docs(path: str) -> list[str]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                docs.append(json.loads(line)["text"] if line.startswith("{") else line)
    return docs


def run(args) -> int:
    from kvblend.config import EngineConfig, ModelConfig
    from kvblend.engine.engine import create_engine
    from kvblend.engine.request import GenerationRequest, SamplingParams

    docs = list(args.doc) + (_read_docs(args.docs_file) if args.docs_file else [])
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    engine = create_engine(
        EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device))
    )
    segs = engine.segments(docs, args.question, instruction=args.instruction)
    if args.mode in ("reuse", "blend"):
        engine.precompute(
            segs.chunk_ids
        )  # a one-shot run has an empty store: fill it first, untimed
    policy = PrefillPolicy.from_fields(args.mode, args.ratio, args.selection)
    result = engine.run(GenerationRequest(segs, sampling, policy, fidelity=args.fidelity))
    if args.json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "finish_reason": result.finish_reason,
                    **result.stats.as_dict(),
                }
            )
        )
    else:
        s = result.stats
        print(result.text)
        how = f"{s.mode} r={s.recompute_ratio:g}" + (f" {s.selection}" if s.selection else "")
        print(
            f"[{how}: {s.prompt_tokens} prompt tokens, {s.cached_tokens} cached "
            f"({s.recomputed_tokens} recomputed), TTFT {s.ttft_ms:.0f} ms]"
        )
    return 0
