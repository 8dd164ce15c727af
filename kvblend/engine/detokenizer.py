"""Incremental detokenization with stop strings: each sampled token's text delta.

A fast (``tokenizers``-backed) tokenizer decodes through ``tokenizers``' ``DecodeStream``, which
decodes only a short window of recent tokens per step, so streaming a long answer costs no re-decode
of its whole text at every token. A slow tokenizer (or one that cleans up spaces after decoding,
which a window cannot reproduce) re-decodes the whole sequence each step, as the engine always did.

The visible text is ``tokenizer.decode(ids, skip_special_tokens=True)`` less what is held back: a
stop string ends it (the stop excluded); a tail that may be the start of a stop string, and an
incomplete UTF-8 character (``\\ufffd``), wait for the next token. The deltas concatenate to the
final text.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence ends with
ANCHOR_TOKENS = 4  # decoded tokens kept as context for the text of an incomplete character


def _decode_stream_class():
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers < 0.21
        return None
    return DecodeStream


class Detokenizer:
    """One sequence's text: ``add(token_id)`` returns the token's visible delta; ``stopped`` once
    a stop string was found (the text then ends before it)."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.text = ""  # emitted so far (stop strings never included)
        self.stopped = False
        self._ids: list[int] = []  # every token, for the full re-decode
        self._decoded = ""  # the stream's text so far: whole characters only
        self._pending_ids: list[int] = []  # tokens the stream has not turned into text yet
        self._anchor_ids: list[int] = []  # the last tokens the stream turned into text
        self._tail = ""  # the pending tokens' text (ends with an incomplete character)
        self._backend, self._stream = _stream_for(tokenizer)

    @property
    def incremental(self) -> bool:
        return self._stream is not None

    def add(self, token_id: int, last: bool = False) -> str:
        """Record ``token_id``; ``last``: no token follows (max_tokens), so nothing is held back.
        Returns the text this token makes visible."""
        full, start = self._extend(token_id)
        hold = 0
        for stop in self.stop:
            at = full.find(stop, max(0, start - len(stop) + 1)) if stop else -1
            if at != -1:
                full, self.stopped = full[:at], True
                break
            hold = max(hold, partial_suffix(full, stop))
        if not self.stopped:
            if last:
                hold = 0
            elif full.endswith(REPLACEMENT):
                hold = max(hold, 1)  # an incomplete UTF-8 sequence: wait for the next token
        visible = full[: len(full) - hold] if hold else full
        delta = visible[len(self.text) :] if visible.startswith(self.text) else ""
        self.text += delta
        return delta

    def _extend(self, token_id: int) -> tuple[str, int]:
        """(the decoded text with ``token_id``, where a stop string not seen before may start)."""
        self._ids.append(token_id)  # kept for the full re-decode, should the stream fail
        if self._stream is not None:
            try:
                return self._step(token_id), len(self.text)
            except Exception as e:  # the stream's window lost track: re-decode from now on
                log.warning("incremental detokenization failed (%s): decoding in full", e)
                self._stream = None
        return self.tokenizer.decode(self._ids, skip_special_tokens=True), 0

    def _step(self, token_id: int) -> str:
        piece = self._stream.step(self._backend, token_id)
        self._pending_ids.append(token_id)
        if piece is not None:
            self._decoded += piece
            self._anchor_ids = (self._anchor_ids + self._pending_ids)[-ANCHOR_TOKENS:]
            self._pending_ids, self._tail = [], ""
            return self._decoded
        self._tail = self._pending_text()
        return self._decoded + self._tail

    def _pending_text(self) -> str:
        """The pending tokens' text, decoded after the last few decoded tokens (so a leading space
        comes out as it does in the whole text); "" when that context's text does not carry over."""
        anchor = self._backend.decode(self._anchor_ids, skip_special_tokens=True)
        both = self._backend.decode(self._anchor_ids + self._pending_ids, skip_special_tokens=True)
        return both[len(anchor) :] if both.startswith(anchor) else ""


def _stream_for(tokenizer):
    """(the ``tokenizers.Tokenizer``, a fresh DecodeStream), or (None, None): decode in full."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    stream_class = _decode_stream_class()
    if (
        backend is None
        or stream_class is None
        or not getattr(tokenizer, "is_fast", False)
        or getattr(tokenizer, "clean_up_tokenization_spaces", False)
    ):
        return None, None
    return backend, stream_class(skip_special_tokens=True)


def partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop`` (held back)."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
