"""Per-tier counters, shared by every backend so each reports the same fields."""

from __future__ import annotations

import threading

COUNTERS = ("hits", "misses", "writes", "evictions", "corrupt", "errors")


class TierStats:
    """Thread-safe monotonically increasing counters (hits, misses, writes, evictions,
    corrupt, errors)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._c = dict.fromkeys(COUNTERS, 0)

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] = self._c.get(name, 0) + n

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._c.get(name, 0)

    def snapshot(self, **extra) -> dict:
        """Counters merged with tier-specific gauges such as entries / bytes / budget_bytes."""
        with self._lock:
            return {**extra, **self._c}
