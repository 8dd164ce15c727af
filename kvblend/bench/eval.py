"""Quality + latency of prefill modes through an OpenAI-style endpoint (the core
of ``kvblend eval``).

Every example is asked once per mode (kvblend's per-request override, sent via extra_body) with the
same prompt. Scores: SQuAD F1 and Rouge-L against the gold answers, and agreement with the ``full``
mode's answer (normalised exact match, and Rouge-L against it): how far reuse moves the output away
from what full prefill would have said. TTFT is the client-side time to the first content token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvblend.bench.common import make_progress, markdown_table, ms, report_header
from kvblend.bench.data import DEFAULT_INSTRUCTION, QAExample, build_prompt, user_messages
from kvblend.bench.metrics import (
    clean_answer,
    exact_match,
    f1_score,
    max_over_golds,
    rouge_l,
    summarize,
)
from kvblend.client.auth import Endpoint
from kvblend.client.stream import ChatRequest, StreamResult, merge_extra_body, policy_extra_body
from kvblend.policy import PrefillPolicy

REFERENCE_MODE = "full"


@dataclass
class EvalConfig:
    modes: list[PrefillPolicy]
    max_tokens: int = 32
    n_docs: int | None = None  # passages per example; None: all of them
    instruction: str = DEFAULT_INSTRUCTION
    # Before the timed modes, one untimed request per example lets a chunk cache fill, so
    # reuse/blend TTFT measures reuse rather than the first computation of every chunk.
    prewarm: bool = True
    extra_body: dict | None = None
    # Timed requests send the passages shuffled against the warm-up's order, as re-ranked retrieval
    # does: prefix caching then hits only the instruction, chunk reuse hits every passage.
    shuffle: bool = True
    seed: int = 0
    labels: list[str] = field(init=False)

    def __post_init__(self):
        self.labels = [m.label for m in self.modes]
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"duplicate modes in {self.labels}")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")

    def prewarm_modes(self) -> list[PrefillPolicy]:
        """Untimed warm-up modes: a chunk-storing one (blend / reuse) so their chunks are
        stored, and prefix so prefix caching has seen the warm-up order. Empty when
        nothing reuses anything."""
        if not self.prewarm:
            return []
        return [
            next(m for m in self.modes if (m.mode or "default") in wanted)
            for wanted in (("blend", "reuse"), ("prefix", "default"))
            if any((m.mode or "default") in wanted for m in self.modes)
        ]

    def timed_passages(self, passages: list[str], index: int) -> list[str]:
        if not self.shuffle:
            return list(passages)
        order = list(passages)
        random.Random(self.seed * 100_003 + index).shuffle(order)
        return order


def score_answer(answer: str, golds: list[str]) -> dict:
    if not golds:
        return {"f1": None, "em": None, "rougeL": None}
    return {
        "f1": max_over_golds(f1_score, answer, golds),
        "em": max_over_golds(exact_match, answer, golds),
        "rougeL": max_over_golds(rouge_l, answer, golds),
    }


def add_agreement(records: list[dict], labels: list[str]) -> None:
    """Per record: agreement with the reference mode's answer to the same example
    (None without one)."""
    reference = {r["qid"]: r for r in records if r["mode"] == REFERENCE_MODE and r["error"] is None}
    for r in records:
        ref = reference.get(r["qid"])
        if ref is None or r["error"] is not None:
            r["agree_em"] = r["agree_rougeL"] = None
        else:
            r["agree_em"] = exact_match(r["answer"], ref["answer"])
            r["agree_rougeL"] = (
                rouge_l(r["answer"], ref["answer"]) if ref["answer"] or r["answer"] else 1.0
            )


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def summarize_mode(records: list[dict]) -> dict:
    ok = [r for r in records if r["error"] is None]
    reported = [r for r in ok if r["cached_tokens"] is not None and r["prompt_tokens"]]
    return {
        "n": len(records),
        "errors": len(records) - len(ok),
        "first_error": next((r["error"] for r in records if r["error"]), None),
        "f1": _mean([r["f1"] for r in ok]),
        "em": _mean([r["em"] for r in ok]),
        "rougeL": _mean([r["rougeL"] for r in ok]),
        "agree_em": _mean([r["agree_em"] for r in ok]),
        "agree_rougeL": _mean([r["agree_rougeL"] for r in ok]),
        "ttft_ms": summarize([r["ttft_ms"] for r in ok]).to_dict(),
        "cached_share": (
            sum(r["cached_tokens"] for r in reported) / sum(r["prompt_tokens"] for r in reported)
            if reported
            else None
        ),
    }


def _record(ex: QAExample, mode: PrefillPolicy, r: StreamResult) -> dict:
    answer = clean_answer(r.text)
    return {
        "qid": ex.qid,
        "mode": mode.label,
        "question": ex.question,
        "golds": ex.answers,
        "raw": r.text,
        "answer": answer,
        **(score_answer(answer, ex.answers) if r.ok else score_answer("", [])),
        "ttft_ms": ms(r.ttft_s),
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "error": r.error,
        "usage_extra": r.extra or None,
    }


async def eval_endpoint(
    endpoint: Endpoint, examples: list[QAExample], cfg: EvalConfig, progress
) -> dict:
    from kvblend.client.stream import make_async_client, resolve_model_id, stream_chat

    client = make_async_client(endpoint)
    records: list[dict] = []
    try:
        model = await resolve_model_id(client, endpoint)
        task = progress.add_task(f"eval {endpoint.name}", total=len(examples) * len(cfg.modes))
        for i, ex in enumerate(examples):
            passages = ex.passages[: cfg.n_docs] if cfg.n_docs else ex.passages
            warm_messages = user_messages(build_prompt(cfg.instruction, passages, ex.question))
            messages = user_messages(
                build_prompt(cfg.instruction, cfg.timed_passages(passages, i), ex.question)
            )
            for warm in cfg.prewarm_modes():
                await stream_chat(
                    client,
                    model,
                    ChatRequest(
                        warm_messages,
                        1,
                        extra_body=merge_extra_body(cfg.extra_body, policy_extra_body(warm)),
                    ),
                )
            for (
                mode
            ) in cfg.modes:  # sequential: concurrent requests would inflate each other's TTFT
                r = await stream_chat(
                    client,
                    model,
                    ChatRequest(
                        messages,
                        cfg.max_tokens,
                        extra_body=merge_extra_body(cfg.extra_body, policy_extra_body(mode)),
                    ),
                )
                records.append(_record(ex, mode, r))
                progress.advance(task)
    finally:
        await client.close()
    add_agreement(records, cfg.labels)
    modes = {
        label: summarize_mode([r for r in records if r["mode"] == label]) for label in cfg.labels
    }
    return {"endpoint": endpoint.public_dict(), "model": model, "modes": modes, "records": records}


def run_eval(
    endpoints: list[Endpoint], examples: list[QAExample], cfg: EvalConfig, data_name: str
) -> dict:
    import asyncio

    config = {
        "modes": cfg.labels,
        "max_tokens": cfg.max_tokens,
        "n_docs": cfg.n_docs,
        "prewarm": cfg.prewarm,
        "extra_body": cfg.extra_body,
        "instruction": cfg.instruction,
        "data": data_name,
        "examples": len(examples),
    }
    report = report_header("eval", config)
    with make_progress() as progress:
        report["endpoints"] = [
            asyncio.run(eval_endpoint(ep, examples, cfg, progress)) for ep in endpoints
        ]
    return report


def table(report: dict) -> str:
    rows = []
    for ep in report["endpoints"]:
        for label, m in ep["modes"].items():
            share = None if m["cached_share"] is None else f"{100 * m['cached_share']:.0f}%"
            rows.append(
                [
                    ep["endpoint"]["name"],
                    label,
                    m["n"] - m["errors"],
                    m["errors"],
                    m["f1"],
                    m["rougeL"],
                    m["agree_em"],
                    m["agree_rougeL"],
                    m["ttft_ms"]["mean"],
                    m["ttft_ms"]["p50"],
                    m["ttft_ms"]["p95"],
                    share,
                ]
            )
    return markdown_table(
        [
            "endpoint",
            "mode",
            "ok",
            "errors",
            "F1",
            "Rouge-L",
            "agree EM vs full",
            "Rouge-L vs full",
            "TTFT mean ms",
            "p50 ms",
            "p95 ms",
            "cached share",
        ],
        rows,
    )
