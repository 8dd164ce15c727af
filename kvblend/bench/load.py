"""``kvblend bench load``: open-loop load at increasing request rates, comparing prefill modes.

Open loop: arrivals follow a Poisson process at the offered rate and are sent on schedule whether or
not earlier requests finished (a closed loop would slow down with the server and hide queueing).
Each rate is bounded by a request count and an arrival window; in-flight requests then get a drain
timeout. Prompts draw N documents from a small shared pool in random order with a random question,
the RAG traffic chunk reuse is meant for. The knee is the highest offered rate before the server
saturates: TTFT p95 grows past ``knee_factor`` x its lowest-rate value, requests fail or are
dropped, or throughput falls well below the arrival rate.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

from kvblend.bench.common import (
    add_common_arguments,
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
from kvblend.client.stream import ChatRequest, StreamResult, merge_extra_body, policy_extra_body
from kvblend.policy import PrefillPolicy

THROUGHPUT_FLOOR = 0.8  # throughput below this share of the arrival rate counts as saturation


@dataclass
class LoadConfig:
    rates: list[float]  # offered request rates (req/s), run in ascending order
    modes: list[PrefillPolicy]
    requests: int = 20  # arrivals per rate at most
    duration_s: float = 60.0  # arrival window per rate at most
    drain_s: float = (
        120.0  # wait for in-flight requests after the last arrival; later ones count as timeouts
    )
    n_docs: int = 4
    pool_docs: int = 8
    max_tokens: int = 16
    max_inflight: int = (
        64  # arrivals beyond this many in flight are dropped (and counted), not queued here
    )
    knee_factor: float = 2.0
    seed: int = 0
    instruction: str = DEFAULT_INSTRUCTION
    extra_body: dict | None = None
    labels: list[str] = field(init=False)

    def __post_init__(self):
        self.rates = sorted(float(r) for r in self.rates)
        if not self.rates or self.rates[0] <= 0:
            raise ValueError(f"rates must be positive, got {self.rates}")
        if self.pool_docs < self.n_docs:
            raise ValueError(f"pool_docs ({self.pool_docs}) must be >= n_docs ({self.n_docs})")
        if self.requests < 1 or self.duration_s <= 0 or self.drain_s <= 0 or self.max_inflight < 1:
            raise ValueError("requests, duration, drain and max_inflight must be positive")
        self.labels = [m.label for m in self.modes]


def poisson_arrivals(rate: float, count: int, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival offsets (s): exponential gaps with mean 1/rate, at most ``count``, all
    within ``duration_s``."""
    out, t = [], 0.0
    while len(out) < count:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        out.append(t)
    return out


def rag_prompts(
    pool: list[str], qs: list[str], count: int, cfg: LoadConfig, rng: random.Random
) -> list[str]:
    return [
        build_prompt(cfg.instruction, rng.sample(pool, cfg.n_docs), rng.choice(qs))
        for _ in range(count)
    ]


@dataclass
class Timed:
    sent_at: float  # seconds since the rate's start
    finished_at: float
    result: StreamResult


async def run_rate(
    client,
    model: str,
    rate: float,
    prompts: list[str],
    arrivals: list[float],
    cfg: LoadConfig,
    extra_body: dict | None,
    on_done=None,
) -> dict:
    import asyncio

    from kvblend.client.stream import stream_chat

    loop = asyncio.get_running_loop()
    start = loop.time()
    inflight = 0
    dropped = 0

    async def one(prompt: str) -> Timed:
        nonlocal inflight
        sent = loop.time() - start
        try:
            r = await stream_chat(
                client,
                model,
                ChatRequest(user_messages(prompt), cfg.max_tokens, extra_body=extra_body),
            )
        finally:
            inflight -= 1
        if on_done:
            on_done()
        return Timed(sent, loop.time() - start, r)

    tasks = []
    for at, prompt in zip(arrivals, prompts):
        delay = start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if inflight >= cfg.max_inflight:
            dropped += 1
            if on_done:
                on_done()
            continue
        inflight += 1
        tasks.append(asyncio.create_task(one(prompt)))
    done, pending = await asyncio.wait(tasks, timeout=cfg.drain_s) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    timed = [t.result() for t in done]
    ok = [x for x in timed if x.result.ok]
    # Rates between first and last event, (n-1)/span for both sides: a served-on-time run gives
    # throughput ~= arrival rate, a saturated one completes at the server's service rate.
    finish_span = (
        (max(x.finished_at for x in ok) - min(x.finished_at for x in ok)) if len(ok) > 1 else None
    )
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else None
    reported = [
        x.result for x in ok if x.result.cached_tokens is not None and x.result.prompt_tokens
    ]
    return {
        "rate": rate,
        "arrivals": len(arrivals),
        "sent": len(tasks),
        "dropped": dropped,
        "completed": len(ok),
        "errors": len(timed) - len(ok),
        "timeouts": len(pending),
        "first_error": next((x.result.error for x in timed if not x.result.ok), None),
        "arrival_rps": (len(arrivals) - 1) / span
        if span
        else None,  # realised; few arrivals stray from nominal
        "throughput_rps": (len(ok) - 1) / finish_span if finish_span else None,
        "ttft_ms": summarize([ms(x.result.ttft_s) for x in ok]).to_dict(),
        "latency_ms": summarize([ms(x.result.total_s) for x in ok]).to_dict(),
        "cached_share": (
            sum(r.cached_tokens for r in reported) / sum(r.prompt_tokens for r in reported)
            if reported
            else None
        ),
    }


def is_saturated(run: dict, base_p95: float | None, knee_factor: float) -> bool:
    if run["dropped"] or run["errors"] or run["timeouts"] or not run["completed"]:
        return True
    p95 = run["ttft_ms"]["p95"]
    if base_p95 and p95 is not None and p95 > knee_factor * base_p95:
        return True
    arrival, tp = run["arrival_rps"], run["throughput_rps"]
    return bool(arrival and tp is not None and tp < THROUGHPUT_FLOOR * arrival)


def find_knee(runs: list[dict], knee_factor: float) -> dict:
    """{"knee_rps": highest rate before the first saturated one (None: saturated at the lowest),
    "saturated_at": first saturated rate (None: never within the rates tried)}."""
    base = runs[0]["ttft_ms"]["p95"] if runs else None
    knee = None
    for run in runs:
        if is_saturated(run, base, knee_factor):
            return {"knee_rps": knee, "saturated_at": run["rate"]}
        knee = run["rate"]
    return {"knee_rps": knee, "saturated_at": None}


async def load_endpoint(
    endpoint: Endpoint, pool: list[str], qs: list[str], cfg: LoadConfig, progress
) -> dict:
    from kvblend.client.stream import make_async_client, resolve_model_id, stream_chat

    client = make_async_client(
        endpoint, max_retries=0
    )  # a retry would be a second, unscheduled arrival
    try:
        model = await resolve_model_id(client, endpoint)
        out: dict = {
            "endpoint": endpoint.public_dict(),
            "model": model,
            "modes": {},
            "knees": {},
            "saturation": {},
        }
        for mode in cfg.modes:
            extra = merge_extra_body(cfg.extra_body, policy_extra_body(mode))
            # Warm-up (unmeasured): every pool document once, so reuse modes start
            # from a filled cache.
            for i in range(0, len(pool), cfg.n_docs):
                docs = pool[i : i + cfg.n_docs]
                await stream_chat(
                    client,
                    model,
                    ChatRequest(
                        user_messages(build_prompt(cfg.instruction, docs, qs[0])),
                        1,
                        extra_body=extra,
                    ),
                )
            rng = random.Random(cfg.seed)  # every mode sees the same arrivals and prompts
            runs = []
            for rate in cfg.rates:
                arrivals = poisson_arrivals(rate, cfg.requests, cfg.duration_s, rng)
                prompts = rag_prompts(pool, qs, len(arrivals), cfg, rng)
                task = progress.add_task(
                    f"{endpoint.name} {mode.label} @ {rate:g} req/s", total=len(arrivals)
                )
                runs.append(
                    await run_rate(
                        client,
                        model,
                        rate,
                        prompts,
                        arrivals,
                        cfg,
                        extra,
                        lambda: progress.advance(task),
                    )
                )
            out["modes"][mode.label] = runs
            knee = find_knee(runs, cfg.knee_factor)
            out["knees"][mode.label] = knee["knee_rps"]
            out["saturation"][mode.label] = knee["saturated_at"]
        return out
    finally:
        await client.close()


def run_load(endpoints: list[Endpoint], pool: list[str], qs: list[str], cfg: LoadConfig) -> dict:
    import asyncio

    config = {k: v for k, v in vars(cfg).items() if k != "modes"}
    report = report_header("load", {**config, "modes": cfg.labels})
    with make_progress() as progress:
        report["endpoints"] = [
            asyncio.run(load_endpoint(ep, pool, qs, cfg, progress)) for ep in endpoints
        ]
    return report


def table(report: dict) -> str:
    rows = []
    for ep in report["endpoints"]:
        for label, runs in ep["modes"].items():
            for r in runs:
                rows.append(
                    [
                        ep["endpoint"]["name"],
                        label,
                        r["rate"],
                        r["sent"],
                        r["completed"],
                        r["errors"] + r["timeouts"] + r["dropped"],
                        r["throughput_rps"],
                        r["ttft_ms"]["p50"],
                        r["ttft_ms"]["p95"],
                        r["latency_ms"]["p95"],
                    ]
                )
    text = markdown_table(
        [
            "endpoint",
            "mode",
            "offered req/s",
            "sent",
            "ok",
            "failed/dropped",
            "throughput req/s",
            "TTFT p50 ms",
            "TTFT p95 ms",
            "latency p95 ms",
        ],
        rows,
    )
    knees = []
    for ep in report["endpoints"]:
        for label, knee in ep["knees"].items():
            sat = ep["saturation"][label]
            where = (
                f"saturates at {sat:g} req/s"
                if sat is not None
                else "not saturated within the rates tried"
            )
            kneed = f"{knee:g} req/s" if knee is not None else "below the lowest rate"
            knees.append(f"knee {ep['endpoint']['name']} {label}: {kneed} ({where})")
    return text + "\n\n" + "\n".join(knees)


def _rates(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates must be numbers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_endpoint_arguments(parser, multiple=True)
    add_common_arguments(parser)
    parser.add_argument(
        "--rates", type=_rates, default=[0.25, 0.5, 1.0, 2.0], help="offered req/s, comma list"
    )
    parser.add_argument(
        "--modes",
        default="full,blend@0.15",
        help="comma list of full, prefix, reuse, blend, blend@R, blend@R/SELECTION (deviation, "
        "query, lookahead), default (no override)",
    )
    parser.add_argument(
        "--requests", type=positive_int, default=20, help="arrivals per rate at most"
    )
    parser.add_argument(
        "--duration", type=float, default=60.0, help="arrival window per rate at most (s)"
    )
    parser.add_argument(
        "--drain", type=float, default=120.0, help="wait for in-flight requests after arrivals (s)"
    )
    parser.add_argument("--docs", type=positive_int, default=4, help="documents per prompt")
    parser.add_argument(
        "--pool", type=positive_int, default=8, help="documents the prompts draw from"
    )
    parser.add_argument("--max-inflight", type=positive_int, default=64)
    parser.add_argument(
        "--knee-factor",
        type=float,
        default=2.0,
        help="saturation when TTFT p95 exceeds this multiple of the lowest rate's",
    )


def run(args: argparse.Namespace) -> int:
    from kvblend.client.stream import parse_mode_list

    cfg = LoadConfig(
        rates=args.rates,
        modes=parse_mode_list(args.modes),
        requests=args.requests,
        duration_s=args.duration,
        drain_s=args.drain,
        n_docs=args.docs,
        pool_docs=args.pool,
        max_tokens=args.max_tokens,
        max_inflight=args.max_inflight,
        knee_factor=args.knee_factor,
        seed=args.seed,
        extra_body=merge_extra_body(args.extra_body),
    )
    endpoints = endpoints_from_args(args)
    examples = load_examples(args.data)
    pool = take_passages(examples, cfg.pool_docs, str(args.data), "--pool")
    report = run_load(endpoints, pool, questions(examples, args.seed), cfg)
    report["config"]["data"] = str(args.data)
    from kvblend.bench.plots import plot_load

    publish(report, "load", args.out_dir, table(report), plot_load, args.no_plot)
    return 0
