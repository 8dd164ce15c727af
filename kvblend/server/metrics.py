"""Prometheus metrics, one registry per app (no process globals, so tests can build many apps).

Names keep the ``kvblend_`` prefix; the model label is ``model_name`` as in vLLM, so a vLLM
dashboard carries over by replacing ``vllm:`` with ``kvblend_`` (docs/SERVER.md has the table).
Request-side series are updated by the handlers through a ``RequestTimer`` per generation; queue
depth, store statistics, Redis reachability and the model info are read at scrape time by a custom
collector, so they are never stale and cost nothing between scrapes. No ``*_created`` series.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# The ``*_created`` timestamps double every counter and histogram for no dashboard's benefit.
prometheus_client.disable_created_metrics()

MODEL = "model_name"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4000, 8000, 16000, 32000)
# Store stats whose names say they only grow: counters; everything else numeric: gauges.
_COUNTER_STATS = ("hits", "misses", "puts", "evictions", "errors", "dropped", "gets", "writes")


class Metrics:
    def __init__(
        self,
        queue_depths: Callable[[], dict[str, tuple[int, int]]],
        store_stats: Callable[[], dict],
        model_info: Callable[[], list[dict[str, str]]] | None = None,
    ):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "kvblend_requests",
            "HTTP requests by model, endpoint and status code",
            [MODEL, "endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvblend_ttft_seconds",
            "Time from request arrival to its first token",
            [MODEL],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "kvblend_inter_token_latency_seconds",
            "Time between two streamed tokens",
            [MODEL],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvblend_e2e_request_latency_seconds",
            "Time from arrival to the last token",
            [MODEL],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "kvblend_request_queue_time_seconds",
            "Time a request waited for the engine",
            [MODEL],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.request_prompt = Histogram(
            "kvblend_request_prompt_tokens",
            "Prompt tokens per request",
            [MODEL],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation = Histogram(
            "kvblend_request_generation_tokens",
            "Generated tokens per request",
            [MODEL],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "kvblend_prefill_seconds",
            "Engine-reported prefill time (PrefillStats.ttft_ms)",
            [MODEL, "mode"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvblend_prompt_tokens",
            "Prompt tokens by where their KV came from",
            [MODEL, "kind"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "kvblend_completion_tokens", "Generated tokens", [MODEL], registry=r
        )
        self.chunks = Counter(
            "kvblend_chunks",
            "Prompt chunks looked up in the store, by outcome",
            [MODEL, "outcome"],
            registry=r,
        )
        self.no_reuse = Counter(
            "kvblend_unsegmented_prompts",
            "Long prompts in which no document (no_chunks) or one (one_chunk) was found: "
            "nothing can be reused across orders",
            [MODEL, "reason"],
            registry=r,
        )
        ProcessCollector(
            registry=r
        )  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        PlatformCollector(registry=r)  # python_info
        r.register(_LiveCollector(queue_depths, store_stats, model_info or (lambda: [])))

    def observe_request(self, model: str, endpoint: str, status: int) -> None:
        self.requests.labels(model or "", endpoint, str(status)).inc()

    def observe_generation(self, model: str, kvblend: dict | None, completion_tokens: int) -> None:
        self.completion_tokens.labels(model).inc(completion_tokens)
        if not kvblend:
            return
        for kind in ("reused", "recomputed", "fresh"):
            self.prompt_tokens.labels(model, kind).inc(int(kvblend.get(f"{kind}_tokens", 0)))
        hit, total = int(kvblend.get("chunks_hit", 0)), int(kvblend.get("chunks_total", 0))
        self.chunks.labels(model, "hit").inc(hit)
        self.chunks.labels(model, "miss").inc(max(0, total - hit))
        if "ttft_ms" in kvblend:
            self.prefill.labels(model, str(kvblend.get("mode", ""))).observe(
                float(kvblend["ttft_ms"]) / 1000
            )

    def timer(self, model: str, arrival: float) -> "RequestTimer":
        return RequestTimer(self, model, arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def register_fidelity(self, fidelity_stats: Callable[[], dict[str, dict]]) -> None:
        """Fidelity targets (kvblend/engine/fidelity.py): the agreement with full
        prefill per model."""
        self.registry.register(_FidelityCollector(fidelity_stats))


class _FidelityCollector(Collector):
    """First-token agreement with full prefill per model, read at scrape time: as calibrated for the
    configured target's setting, and as measured by shadow full prefills of live requests."""

    def __init__(self, fidelity_stats: Callable[[], dict[str, dict]]):
        self.fidelity_stats = fidelity_stats

    def collect(self) -> Iterable:
        agreement = GaugeMetricFamily(
            "kvblend_fidelity_agreement",
            "First-token agreement with full prefill (source: calibration | shadow)",
            labels=["model_name", "source"],
        )
        shadows = GaugeMetricFamily(
            "kvblend_fidelity_shadow_prefills",
            "Shadow full prefills that measured the live agreement",
            labels=["model_name"],
        )
        try:
            stats = self.fidelity_stats()
        except Exception:  # a scrape never fails on this
            log.exception("fidelity stats failed")
            stats = {}
        for model, s in stats.items():
            if s.get("calibrated") is not None:
                agreement.add_metric([model, "calibration"], float(s["calibrated"]))
            if s.get("live") is not None:
                agreement.add_metric([model, "shadow"], float(s["live"]))
            shadows.add_metric([model], float(s.get("live_n", 0)))
        yield agreement
        yield shadows


class RequestTimer:
    """One generation's latency and token series: TTFT once, a gap per streamed piece, and on
    ``finish`` (called once, also when the client cut the stream) e2e and token counts."""

    def __init__(self, metrics: Metrics, model: str, arrival: float):
        self.m, self.model, self.arrival = metrics, model, arrival
        self.last: float | None = None
        self.done = False

    def first_token(self, queue_s: float | None = None) -> None:
        """The first token exists (the prefill returned); the queue wait when the backend knows."""
        self.last = time.perf_counter()
        self.m.ttft.labels(self.model).observe(self.last - self.arrival)
        if queue_s is not None:
            self.m.queue_time.labels(self.model).observe(queue_s)

    def token(self) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.m.inter_token.labels(self.model).observe(now - self.last)
        self.last = now

    def finish(self, kvblend: dict | None, prompt_tokens: int, completion_tokens: int) -> None:
        if self.done:
            return
        self.done = True
        m = self.m
        m.e2e.labels(self.model).observe(time.perf_counter() - self.arrival)
        if prompt_tokens:
            m.request_prompt.labels(self.model).observe(prompt_tokens)
        m.request_generation.labels(self.model).observe(completion_tokens)
        m.observe_generation(self.model, kvblend, completion_tokens)


def store_tiers(stats: dict) -> dict[str, dict]:
    """``store.stats()`` as {tier: {stat: number}}, whether it reports tiers or a flat dict."""
    if not isinstance(stats, dict):
        return {}
    nested = {k: v for k, v in stats.items() if isinstance(v, dict)}
    flat = {k: v for k, v in stats.items() if _is_number(v)}
    out = {str(tier): {k: v for k, v in d.items() if _is_number(v)} for tier, d in nested.items()}
    if flat:
        out.setdefault("store", {}).update(flat)
    return out


def store_reachability(stats: dict) -> dict[str, bool]:
    """{tier: reachable} for the tiers that report ``available`` (remote ones: Redis)."""
    if not isinstance(stats, dict):
        return {}
    out = {
        str(t): bool(d["available"])
        for t, d in stats.items()
        if isinstance(d, dict) and isinstance(d.get("available"), bool)
    }
    if isinstance(stats.get("available"), bool):
        out["store"] = stats["available"]
    return out


PROBE_KEY = "kvblend-reachability-probe"


def probe_remote_tiers(store) -> None:
    """One cheap lookup in each remote tier (those with ``available``), so that their circuit state
    (and ``kvblend_store_reachable``) follows the server even while no request touches it. A dead
    server costs one short socket timeout, then nothing until its backoff ends."""
    for tier in getattr(store, "tiers", [store]):
        if hasattr(tier, "available") and hasattr(tier, "contains"):
            try:
                tier.contains(PROBE_KEY)
            except Exception:  # a probe must never break the scrape
                log.debug("store probe failed", exc_info=True)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _LiveCollector(Collector):
    def __init__(
        self,
        queue_depths: Callable[[], dict[str, tuple[int, int]]],
        store_stats: Callable[[], dict],
        model_info: Callable[[], list[dict[str, str]]],
    ):
        self._queue_depths = queue_depths
        self._store_stats = store_stats
        self._model_info = model_info

    def collect(self) -> Iterable:
        depth = GaugeMetricFamily(
            "kvblend_queue_depth", "Requests waiting for a model's engine", labels=[MODEL]
        )
        active = GaugeMetricFamily(
            "kvblend_active_sequences", "Sequences being decoded", labels=[MODEL]
        )
        for model, (waiting, running) in self._queue_depths().items():
            depth.add_metric([model], waiting)
            active.add_metric([model], running)
        yield depth
        yield active
        yield from self._info()
        try:
            raw = self._store_stats()
        except Exception:  # a remote tier being down must not break the scrape
            log.warning("store.stats() failed", exc_info=True)
            raw = {}
        reach = GaugeMetricFamily(
            "kvblend_store_reachable",
            "1 while a remote store tier (Redis) answers, 0 while its circuit is open",
            labels=["tier"],
        )
        for tier, up in sorted(store_reachability(raw).items()):
            reach.add_metric([tier], 1.0 if up else 0.0)
        yield reach
        yield from _store_families(store_tiers(raw))

    def _info(self) -> Iterable:
        infos = self._model_info()
        keys = sorted({k for i in infos for k in i})
        fam = GaugeMetricFamily(
            "kvblend_model_info",
            "Served models: version, dtype, attention kernel (value 1)",
            labels=keys,
        )
        for info in infos:
            fam.add_metric([str(info.get(k, "")) for k in keys], 1.0)
        yield fam


def _store_families(tiers: dict[str, dict]) -> Iterable:
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for tier, stats in sorted(tiers.items()):
        for stat, value in sorted(stats.items()):
            name = "".join(c if c.isalnum() else "_" for c in stat.lower())
            if name.endswith("_total"):
                name = name[: -len("_total")]
            kind = CounterMetricFamily if name in _COUNTER_STATS else GaugeMetricFamily
            fam = families.setdefault(
                name, kind(f"kvblend_store_{name}", f"Chunk store {name}, by tier", labels=["tier"])
            )
            fam.add_metric([tier], float(value))
    yield from families.values()
