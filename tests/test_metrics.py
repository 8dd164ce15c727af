"""kvblend/server/metrics.py with a real redis-server: the reachability gauge follows it."""

from __future__ import annotations

import time

from kvblend.config import StoreConfig
from kvblend.server.metrics import Metrics, probe_remote_tiers
from kvblend.store.factory import create_store


def _reachable(metrics: Metrics) -> float | None:
    for line in metrics.render().decode().splitlines():
        if line.startswith('kvblend_store_reachable{tier="redis"}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_redis_reachability_gauge_follows_the_server(redis_server, tmp_path):
    cfg = StoreConfig(
        tiers=("memory", "redis"),
        redis_url=redis_server.url,
        redis_socket_timeout_s=0.2,
        redis_backoff_s=0.05,
        redis_backoff_max_s=0.2,
    )
    store = create_store(cfg)

    def stats() -> dict:
        probe_remote_tiers(store)
        return store.stats()

    metrics = Metrics(lambda: {}, stats, lambda: [{"model_name": "m", "dtype": "bfloat16"}])
    try:
        assert _reachable(metrics) == 1.0
        text = metrics.render().decode()
        assert (
            "_created" not in text
            and 'kvblend_model_info{dtype="bfloat16",model_name="m"} 1.0' in text
        )
        redis_server.stop()
        assert (
            _reachable(metrics) == 0.0
        )  # no request touched the store: the scrape's probe found it
        redis_server.start()
        deadline = time.monotonic() + 10
        while _reachable(metrics) != 1.0:
            assert time.monotonic() < deadline, "the gauge never came back after redis restarted"
            time.sleep(0.1)
    finally:
        if hasattr(store, "close"):
            store.close()
