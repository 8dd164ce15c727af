"""Say when reuse cannot happen: a long prompt in which kvblend found no document, or only one.

Such a prompt is prefilled (or prefix-cached) whole; none of it is reused when the same documents
come again in another order. The response says so in an ``X-KVBlend-Warning`` header and in
``usage.kvblend.warning``, and ``/metrics`` counts it (``kvblend_unsegmented_prompts_total``).
"""

from __future__ import annotations

HEADER = "X-KVBlend-Warning"
LONG_PROMPT_TOKENS = 1024  # shorter prompts cost little to prefill whole: no warning
_HOW = (
    "send each document as its own content part, in `documents`, or separated by blank lines; "
    "see docs/FRAMEWORKS.md"
)


def reuse_warning(stats: dict | None) -> tuple[str, str] | None:
    """(reason, message) for a prefill's stats (``PrefillStats.as_dict()``), or None."""
    if not stats or stats.get("mode") not in ("reuse", "blend"):
        return None  # full / prefix modes do not reuse chunks: nothing to warn about
    num_tokens, num_chunks = int(stats.get("prompt_tokens", 0)), int(stats.get("chunks_total", 0))
    if num_tokens < LONG_PROMPT_TOKENS or num_chunks > 1:
        return None
    found = "no document" if num_chunks == 0 else "only one document"
    reason = "no_chunks" if num_chunks == 0 else "one_chunk"
    return (
        reason,
        f"kvblend found {found} in this {num_tokens}-token prompt, so none of it can be reused "
        f"when the documents come in another order: {_HOW}.",
    )


def warn(state, model: str, gen) -> dict[str, str]:
    """The warning of a local prefill (``gen.stats``): counted in ``state.metrics``, copied into
    ``usage.kvblend`` (``gen.warning``), returned as response headers."""
    stats = getattr(gen, "stats", None)
    found = reuse_warning(stats.as_dict()) if hasattr(stats, "as_dict") else None
    if found is None:
        return {}
    reason, message = found
    state.metrics.no_reuse.labels(model, reason).inc()
    gen.warning = message
    return {HEADER: message}
