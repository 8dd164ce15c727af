"""Stable keys for chunk KV: never Python's ``hash`` (salted per process), always sha256.

Two keying policies (see LMCache's token database):
- chunk keys are position independent: model + layout + namespace + context + the chunk's own ids;
- prefix keys are chained: a segment's key covers every token before it, as prefix caching needs.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KV_LAYOUT_VERSION = 1


def _ids_bytes(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(struct.pack("<Q", len(p)))  # length-prefixed: no ambiguity between parts
        h.update(p)
    return h.hexdigest()


def make_chunk_key(
    model_fingerprint: str,
    context_ids: Sequence[int],
    token_ids: Sequence[int],
    namespace: str = "",
) -> str:
    """Key of a chunk prefilled alone behind ``context_ids`` (whose own KV is dropped)."""
    return "chunk:" + _digest(
        b"chunk",
        model_fingerprint.encode(),
        str(KV_LAYOUT_VERSION).encode(),
        namespace.encode(),
        _ids_bytes(context_ids),
        _ids_bytes(token_ids),
    )


def make_prefix_key(
    model_fingerprint: str, parent_key: str | None, token_ids: Sequence[int], namespace: str = ""
) -> str:
    """Key of a segment prefilled in the exact context of all segments before it (chained)."""
    return "prefix:" + _digest(
        b"prefix",
        model_fingerprint.encode(),
        str(KV_LAYOUT_VERSION).encode(),
        namespace.encode(),
        (parent_key or "").encode(),
        _ids_bytes(token_ids),
    )
