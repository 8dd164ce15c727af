"""Prometheus metrics, one registry per app (no process globals, so tests can build many apps).

Request-side counters are updated by the handlers; queue depth and store statistics are read at
scrape time by a custom collector, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Store stats whose names say they only grow; exported as counters, everything else numeric as gauges.
_COUNTER_STATS = ("hits", "misses", "puts", "evictions", "errors", "dropped", "gets", "writes")


class Metrics:
    def __init__(self, queue_depths: Callable[[], dict[str, tuple[int, int]]], store_stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.requests = Counter("kvblend_requests", "HTTP requests by model, endpoint and status code",
                                ["model", "endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("kvblend_ttft_seconds", "Time from request arrival to first token, as served",
                              ["model"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.prefill = Histogram("kvblend_prefill_seconds", "Engine-reported prefill time (PrefillStats.ttft_ms)",
                                 ["model", "mode"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("kvblend_prompt_tokens", "Prompt tokens by where their KV came from",
                                     ["model", "kind"], registry=self.registry)
        self.completion_tokens = Counter("kvblend_completion_tokens", "Generated tokens", ["model"],
                                         registry=self.registry)
        self.chunks = Counter("kvblend_chunks", "Prompt chunks looked up in the store, by outcome",
                              ["model", "outcome"], registry=self.registry)
        self.registry.register(_LiveCollector(queue_depths, store_stats))

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
            self.prefill.labels(model, str(kvblend.get("mode", ""))).observe(float(kvblend["ttft_ms"]) / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def register_fidelity(self, fidelity_stats: Callable[[], dict[str, dict]]) -> None:
        """Fidelity targets (kvblend/engine/fidelity.py): the agreement with full prefill per model."""
        self.registry.register(_FidelityCollector(fidelity_stats))


class _FidelityCollector(Collector):
    """First-token agreement with full prefill per model, read at scrape time: as calibrated for the
    configured target's setting, and as measured by shadow full prefills of live requests."""

    def __init__(self, fidelity_stats: Callable[[], dict[str, dict]]):
        self.fidelity_stats = fidelity_stats

    def collect(self) -> Iterable:
        agreement = GaugeMetricFamily("kvblend_fidelity_agreement",
                                      "First-token agreement with full prefill (source: calibration | shadow)",
                                      labels=["model", "source"])
        shadows = GaugeMetricFamily("kvblend_fidelity_shadow_prefills",
                                    "Shadow full prefills that measured the live agreement", labels=["model"])
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


def store_tiers(stats: dict) -> dict[str, dict]:
    """Normalise ``store.stats()``: {tier: {stat: number}} whether the store reports tiers or a flat dict."""
    if not isinstance(stats, dict):
        return {}
    nested = {k: v for k, v in stats.items() if isinstance(v, dict)}
    flat = {k: v for k, v in stats.items() if _is_number(v)}
    out = {str(tier): {k: v for k, v in d.items() if _is_number(v)} for tier, d in nested.items()}
    if flat:
        out.setdefault("store", {}).update(flat)
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _LiveCollector(Collector):
    def __init__(self, queue_depths: Callable[[], dict[str, tuple[int, int]]], store_stats: Callable[[], dict]):
        self._queue_depths = queue_depths
        self._store_stats = store_stats

    def collect(self) -> Iterable:
        depth = GaugeMetricFamily("kvblend_queue_depth", "Requests waiting for a model's engine", labels=["model"])
        active = GaugeMetricFamily("kvblend_active_sequences", "Sequences being decoded", labels=["model"])
        for model, (waiting, running) in self._queue_depths().items():
            depth.add_metric([model], waiting)
            active.add_metric([model], running)
        yield depth
        yield active
        try:
            tiers = store_tiers(self._store_stats())
        except Exception:  # a remote tier being down must not break the scrape
            log.warning("store.stats() failed", exc_info=True)
            tiers = {}
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for tier, stats in sorted(tiers.items()):
            for stat, value in sorted(stats.items()):
                name = "".join(c if c.isalnum() else "_" for c in stat.lower())
                if name.endswith("_total"):
                    name = name[: -len("_total")]
                if name in _COUNTER_STATS:
                    fam = families.setdefault(name, CounterMetricFamily(
                        f"kvblend_store_{name}", f"Chunk store {name}, by tier", labels=["tier"]))
                else:
                    fam = families.setdefault(name, GaugeMetricFamily(
                        f"kvblend_store_{name}", f"Chunk store {name}, by tier", labels=["tier"]))
                fam.add_metric([tier], float(value))
        yield from families.values()
