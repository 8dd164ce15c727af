"""``kvblend bench ttft``: time to first token for three RAG cache scenarios,
endpoints side by side.

- ``prefix_hit``: one fixed instruction + document prefix, a different question each round. Any
  server with prefix caching (vLLM, SGLang, kvblend) should reuse nearly the whole prompt.
- ``shuffled``: the same N documents in a new order each round. Prefix caching reuses only the
  instruction; chunk-level reuse (kvblend) should still hit every document.
- ``full_recompute``: a unique random prefix and per-document tag each round, so no cache of any
  kind can hit: the baseline cost of a cold prompt of the same size.

TTFT is measured client-side to the first non-empty content delta; warm-up requests are
excluded. The cached-token share comes from ``usage.prompt_tokens_details.cached_tokens`` when
the server reports it.
"""

from __future__ import annotations

import argparse
import random
import secrets
from dataclasses import asdict, dataclass

from kvblend.bench.common import (
    add_common_arguments,
    exit_code_for_errors,
    make_progress,
    markdown_table,
    ms,
    positive_int,
    publish,
    report_header,
)
from kvblend.bench.data import (
    DEFAULT_INSTRUCTION,
    build_prompt,
    load_examples,
    questions,
    take_passages,
    user_messages,
)
from kvblend.bench.metrics import summarize
from kvblend.client.auth import Endpoint, add_endpoint_arguments, endpoints_from_args
from kvblend.client.stream import (
    ChatRequest,
    StreamResult,
    merge_extra_body,
    parse_mode_spec,
    policy_extra_body,
)

SCENARIOS = ("prefix_hit", "shuffled", "full_recompute")


@dataclass
class TTFTConfig:
    rounds: int = 5  # measured requests per scenario
    n_docs: int = 4
    concurrency: int = 1
    warmup: int = 1  # requests per scenario sent first and not measured
    max_tokens: int = 8
    seed: int = 0
    instruction: str = DEFAULT_INSTRUCTION
    extra_body: dict | None = None
    scenarios: tuple[str, ...] = SCENARIOS

    def __post_init__(self):
        for name in ("rounds", "n_docs", "concurrency", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown:
            raise ValueError(
                f"unknown scenario(s) {unknown}; expected some of {', '.join(SCENARIOS)}"
            )


def scenario_prompts(
    scenario: str, docs: list[str], qs: list[str], count: int, instruction: str, rng: random.Random
) -> list[str]:
    """``count`` prompts for one scenario; round i asks question i in every scenario, so only the
    document part differs between scenarios."""
    prompts: list[str] = []
    previous: list[str] | None = None
    for i in range(count):
        question = qs[i % len(qs)]
        if scenario == "prefix_hit":
            prompts.append(build_prompt(instruction, docs, question))
        elif scenario == "shuffled":
            order = list(docs)
            for _ in range(20):  # a reshuffle equal to the last order would be a prefix hit
                rng.shuffle(order)
                if order != previous or len(docs) < 2:
                    break
            previous = order
            prompts.append(build_prompt(instruction, order, question))
        elif scenario == "full_recompute":
            # A fresh nonce up front defeats prefix caches; tagging every document defeats chunk
            # caches, while the prompt length stays that of the other scenarios (+ a few
            # tokens). Not seeded: a repeated run (or a second endpoint sharing a cache) must
            # never see the same nonce.
            nonce = secrets.token_hex(6)
            tagged = [f"[{nonce}-{j}] {d}" for j, d in enumerate(docs)]
            prompts.append(build_prompt(f"[session {nonce}] {instruction}", tagged, question))
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
    return prompts


def summarize_results(results: list[StreamResult]) -> dict:
    ok = [r for r in results if r.ok]
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached_share = (
        sum(r.cached_tokens for r in reported) / sum(r.prompt_tokens for r in reported)
        if reported
        else None
    )
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), None),
        "ttft_ms": summarize([ms(r.ttft_s) for r in ok]).to_dict(),
        "total_ms": summarize([ms(r.total_s) for r in ok]).to_dict(),
        "decode_ms_per_token": summarize([decode_ms_per_token(r) for r in ok]).to_dict(),
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        "cached_share": cached_share,
    }


def decode_ms_per_token(r: StreamResult) -> float | None:
    """Time from the first content delta to the end over the tokens after the first, from the
    server's usage; None where a request gave fewer than two tokens or no usage."""
    if r.ttft_s is None or not r.completion_tokens or r.completion_tokens < 2:
        return None
    return ms(r.total_s - r.ttft_s) / (r.completion_tokens - 1)


def _record(r: StreamResult) -> dict:
    return {
        "ttft_ms": ms(r.ttft_s),
        "total_ms": ms(r.total_s),
        "decode_ms_per_token": decode_ms_per_token(r),
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "completion_tokens": r.completion_tokens,
        "error": r.error,
        "text": r.text,
        "usage_extra": r.extra or None,
    }


async def run_batch(
    client, model: str, prompts: list[str], cfg: TTFTConfig, on_done=None
) -> list[StreamResult]:
    """Send prompts with at most ``cfg.concurrency`` in flight; results in prompt order."""
    import asyncio

    from kvblend.client.stream import stream_chat

    gate = asyncio.Semaphore(cfg.concurrency)

    async def one(prompt: str) -> StreamResult:
        async with gate:
            result = await stream_chat(
                client,
                model,
                ChatRequest(user_messages(prompt), cfg.max_tokens, extra_body=cfg.extra_body),
            )
        if on_done:
            on_done()
        return result

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def bench_endpoint(
    endpoint: Endpoint, docs: list[str], qs: list[str], cfg: TTFTConfig, progress
) -> dict:
    from kvblend.client.stream import make_async_client, resolve_model_id

    client = make_async_client(endpoint)
    try:
        model = await resolve_model_id(client, endpoint)
        rng = random.Random(cfg.seed)
        out: dict = {"endpoint": endpoint.public_dict(), "model": model, "scenarios": {}}
        for scenario in cfg.scenarios:
            prompts = scenario_prompts(
                scenario, docs, qs, cfg.warmup + cfg.rounds, cfg.instruction, rng
            )
            task = progress.add_task(f"{endpoint.name} {scenario}", total=len(prompts))
            advance = lambda: progress.advance(task)  # noqa: E731
            # Warm-up runs alone and first: it fills the caches the measured
            # rounds are meant to hit.
            for p in prompts[: cfg.warmup]:
                await run_batch(client, model, [p], cfg, advance)
            measured = await run_batch(client, model, prompts[cfg.warmup :], cfg, advance)
            out["scenarios"][scenario] = {
                **summarize_results(measured),
                "results": [_record(r) for r in measured],
            }
        return out
    finally:
        await client.close()


def run_ttft(endpoints: list[Endpoint], docs: list[str], qs: list[str], cfg: TTFTConfig) -> dict:
    import asyncio

    report = report_header("ttft", {**asdict(cfg), "docs": len(docs)})
    report["endpoints"] = []
    with make_progress() as progress:
        for ep in endpoints:  # endpoints one after another: they may share this machine's CPUs
            report["endpoints"].append(asyncio.run(bench_endpoint(ep, docs, qs, cfg, progress)))
    return report


def table(report: dict) -> str:
    rows = []
    for ep in report["endpoints"]:
        for name, s in ep["scenarios"].items():
            t = s["ttft_ms"]
            share = None if s["cached_share"] is None else f"{100 * s['cached_share']:.0f}%"
            rows.append(
                [
                    ep["endpoint"]["name"],
                    name,
                    s["requests"] - s["errors"],
                    s["errors"],
                    t["mean"],
                    t["p50"],
                    t["p95"],
                    share,
                    s["prompt_tokens_mean"],
                    s["decode_ms_per_token"]["p50"],
                ]
            )
    return markdown_table(
        [
            "endpoint",
            "scenario",
            "ok",
            "errors",
            "TTFT mean ms",
            "p50 ms",
            "p95 ms",
            "cached share",
            "prompt tokens",
            "decode ms/token p50",
        ],
        rows,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_endpoint_arguments(parser, multiple=True)
    add_common_arguments(parser)
    parser.set_defaults(max_tokens=8)
    parser.add_argument(
        "--rounds", type=positive_int, default=5, help="measured requests per scenario"
    )
    parser.add_argument("--docs", type=positive_int, default=4, help="documents per prompt")
    parser.add_argument(
        "--concurrency", type=positive_int, default=1, help="requests in flight at once"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="unmeasured requests per scenario, sent first"
    )
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma list of " + ", ".join(SCENARIOS)
    )
    parser.add_argument(
        "--mode",
        default=None,
        metavar="SPEC",
        help="kvblend per-request prefill override, e.g. blend@0.15 (sent via extra_body)",
    )


def run(args: argparse.Namespace) -> int:
    endpoints = endpoints_from_args(args)
    override = policy_extra_body(parse_mode_spec(args.mode)) if args.mode else None
    cfg = TTFTConfig(
        rounds=args.rounds,
        n_docs=args.docs,
        concurrency=args.concurrency,
        warmup=args.warmup,
        max_tokens=args.max_tokens,
        seed=args.seed,
        extra_body=merge_extra_body(args.extra_body, override),
        scenarios=tuple(s.strip() for s in args.scenarios.split(",") if s.strip()),
    )
    examples = load_examples(args.data)
    docs = take_passages(examples, cfg.n_docs, str(args.data), "--docs")
    report = run_ttft(endpoints, docs, questions(examples, args.seed), cfg)
    report["config"]["data"] = str(args.data)
    from kvblend.bench.plots import plot_ttft

    publish(report, "ttft", args.out_dir, table(report), plot_ttft, args.no_plot)
    return exit_code_for_errors(report, "scenarios")
