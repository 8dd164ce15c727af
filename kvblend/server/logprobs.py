"""Token log-probabilities in the OpenAI wire formats.

The engine reports, per generated token, its log-probability under the model's distribution (before
temperature / top-p, as vLLM does) and the top-k alternatives as token ids; this module turns them
into chat ``logprobs.content`` entries and the legacy completions ``logprobs`` object.
"""

from __future__ import annotations

from collections.abc import Callable

from kvblend.server import errors

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions allow 5


def chat_setting(logprobs: bool | None, top_logprobs: int | None) -> int | None:
    """Chat request fields -> the engine's ``SamplingParams.logprobs`` (None: off)."""
    if top_logprobs is not None and not logprobs:
        raise errors.invalid_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    return (top_logprobs or 0) if logprobs else None


def token_entry(
    decode: Callable[[int], str], token_id: int, logprob: float, top: list[tuple[int, float]] | None
) -> dict:
    """One chat ``logprobs.content`` entry: token text, logprob, UTF-8 bytes, top alternatives."""

    def one(tid: int, lp: float) -> dict:
        text = decode(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {**one(token_id, logprob), "top_logprobs": [one(t, lp) for t, lp in top or []]}


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict] | None, text_offset: int) -> dict | None:
    """The completions endpoint's format; ``text_offset`` is where the first token's text starts."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }
