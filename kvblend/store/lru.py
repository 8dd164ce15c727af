"""Byte-budgeted LRU bookkeeping shared by the memory and disk tiers (not
thread-safe: callers lock)."""

from __future__ import annotations

from collections import OrderedDict


class LRUIndex:
    """key -> size in bytes, least recently used first.

    Invariant (``check``): sum of sizes == ``nbytes`` <= ``budget``.
    """

    def __init__(self, budget: int):
        self.budget = budget
        self.nbytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[str]:
        return list(self._sizes)

    def size(self, key: str) -> int | None:
        return self._sizes.get(key)

    def touch(self, key: str) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def fits(self, size: int) -> bool:
        return size <= self.budget

    def add(self, key: str, size: int) -> list[str]:
        """Insert/refresh ``key`` as most recent; return the keys evicted to stay within budget.

        The caller must check ``fits(size)`` first; the new key itself is never evicted.
        """
        if not self.fits(size):
            raise ValueError(f"entry of {size} bytes exceeds the whole budget ({self.budget})")
        self.remove(key)
        self._sizes[key] = size
        self.nbytes += size
        evicted = []
        while self.nbytes > self.budget:
            old, old_size = self._sizes.popitem(last=False)
            self.nbytes -= old_size
            evicted.append(old)
        return evicted

    def remove(self, key: str) -> int:
        size = self._sizes.pop(key, None)
        if size is None:
            return 0
        self.nbytes -= size
        return size

    def check(self) -> None:
        total = sum(self._sizes.values())
        assert total == self.nbytes, f"tracked bytes {self.nbytes} != sum of entries {total}"
        assert self.nbytes <= self.budget, (
            f"tracked bytes {self.nbytes} exceed budget {self.budget}"
        )
