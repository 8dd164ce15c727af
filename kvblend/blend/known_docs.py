"""Documents kvblend has cached, found again inside text that has no separators around them.

Some clients glue documents together with nothing between them (LlamaIndex sends a text-only
multi-block message as one string), so no layout can tell where one ends. A document the server
has already cached as a chunk (``/v1/chunks``, or any earlier request that separated it) is found
by its exact text wherever it appears. Used only when the layouts found at most one document, so
well-separated prompts never pay for the scan (~5 ms per 25k characters).

Boundaries found this way change how a prompt is split, never which tenant's KV it reads: chunk
keys still carry the namespace.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvblend.blend.layouts import Layout

ANCHOR_CHARS = 48  # a document is looked up by its first characters
MIN_DOCUMENT_CHARS = 64  # shorter texts match too easily by chance and cost little to recompute


class KnownDocuments:
    """The stripped texts of recently cached documents (LRU), indexed by their first characters."""

    def __init__(self, max_documents: int = 16384):
        self.max_documents = max_documents
        self._docs: OrderedDict[str, None] = OrderedDict()
        self._by_anchor: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def add(self, text: str) -> None:
        text = text.strip()
        if len(text) < MIN_DOCUMENT_CHARS:
            return
        with self._lock:
            if text in self._docs:
                self._docs.move_to_end(text)
                return
            self._docs[text] = None
            self._by_anchor.setdefault(text[:ANCHOR_CHARS], set()).add(text)
            if len(self._docs) > self.max_documents:
                old, _ = self._docs.popitem(last=False)
                group = self._by_anchor[old[:ANCHOR_CHARS]]
                group.discard(old)
                if not group:
                    del self._by_anchor[old[:ANCHOR_CHARS]]

    def find(self, text: str) -> list[tuple[int, int]]:
        """Non-overlapping (start, end) spans of known documents in ``text``, left to right (the
        longest where several start at one place)."""
        spans: list[tuple[int, int]] = []
        i, last = 0, len(text) - MIN_DOCUMENT_CHARS
        with self._lock:
            while i <= last:
                group = self._by_anchor.get(text[i : i + ANCHOR_CHARS])
                found = (
                    max((d for d in group if text.startswith(d, i)), key=len, default=None)
                    if group
                    else None
                )
                if found:
                    spans.append((i, i + len(found)))
                    i += len(found)
                else:
                    i += 1
        return spans

    def layout(self, text: str) -> Layout | None:
        """``text`` split at the known documents in it (text between two is glue), or None."""
        spans = self.find(text)
        if not spans:
            return None
        glue = [text[spans[k][1] : spans[k + 1][0]] for k in range(len(spans) - 1)]
        return Layout(
            text[: spans[0][0]], [text[a:b] for a, b in spans], text[spans[-1][1] :], glue
        )
