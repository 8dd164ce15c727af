"""A prompt as segments: prefix (template start + system/instructions), chunks (documents), query.

Each piece is tokenized on its own, so a chunk's token ids are identical wherever it appears. The
joined string is never re-tokenized: every prefill mode sees exactly ``Segments.token_ids``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Separator appended to each chunk's text, so chunks concatenate with no template glue between them.
CHUNK_SEPARATOR = "\n\n"
_MARKER = "\ue000KVBLEND_USER\ue001"


@dataclass
class Segments:
    prefix_ids: list[int]
    chunk_ids: list[list[int]] = field(default_factory=list)
    query_ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        out = list(self.prefix_ids)
        for c in self.chunk_ids:
            out.extend(c)
        out.extend(self.query_ids)
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.prefix_ids) + sum(map(len, self.chunk_ids)) + len(self.query_ids)

    def segment_list(self) -> list[tuple[str, list[int]]]:
        """[(kind, ids)] in prompt order; kind is "prefix", "chunk" or "query"."""
        out = [("prefix", self.prefix_ids)] if self.prefix_ids else []
        out += [("chunk", c) for c in self.chunk_ids]
        if self.query_ids:
            out.append(("query", self.query_ids))
        return out


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` alone: no BOS/EOS, special tokens in the text are parsed (template parts)."""
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def render_template_halves(tokenizer, system: str | None, history: list[dict] | None = None) -> tuple[str, str]:
    """The chat template rendered around the last user turn: (text before its content, text after).

    ``history`` holds earlier messages (system, user, assistant turns); they land in the first half.
    """
    messages = list(history or [])
    if system is not None:
        messages = [{"role": "system", "content": system}] + messages
    messages.append({"role": "user", "content": _MARKER})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if rendered.count(_MARKER) != 1:
        raise ValueError("the chat template did not render the user content verbatim; cannot segment it")
    before, after = rendered.split(_MARKER)
    # Templates print BOS themselves where the model wants one; ``encode`` never adds another.
    return before, after


def build_segments(
    tokenizer,
    documents: list[str],
    question: str,
    instruction: str = "",
    system: str | None = None,
    history: list[dict] | None = None,
) -> Segments:
    """Segments for: [template start, system, history, user: instruction] [doc + sep]... [question + template end]."""
    return build_segments_from_parts(tokenizer, [d + CHUNK_SEPARATOR for d in documents if d], question,
                                     system, history, leading_text=instruction)


def split_plain_text(text: str) -> tuple[list[str], str]:
    """Automatic segmentation of one plain user message: (chunk texts, query text).

    Splits at blank lines (or at line breaks when there are none); each piece keeps its trailing
    separator so ``"".join(chunks) + query == text`` and a document's piece is the same string
    wherever it appears. The last piece is the query.
    """
    sep = r"\n\s*\n" if re.search(r"\n\s*\n", text) else r"\n"
    pieces: list[str] = []
    pos = 0
    for m in re.finditer(sep, text):
        pieces.append(text[pos:m.end()])
        pos = m.end()
    pieces.append(text[pos:])
    pieces = [p for p in pieces if p]
    if len(pieces) <= 1:
        return [], text
    return pieces[:-1], pieces[-1]


def build_segments_from_parts(
    tokenizer, chunk_texts: list[str], query_text: str, system: str | None = None,
    history: list[dict] | None = None, leading_text: str = "",
) -> Segments:
    """Like ``build_segments`` but chunk texts are used verbatim (no separator added)."""
    before, after = render_template_halves(tokenizer, system, history)
    return Segments(
        prefix_ids=encode(tokenizer, before + leading_text),
        chunk_ids=[ids for ids in (encode(tokenizer, t) for t in chunk_texts) if ids],
        query_ids=encode(tokenizer, query_text + after),
    )


def build_completion_segments(tokenizer, prompt: str | list[int], documents: list[str]) -> Segments:
    """Segments for a raw completion prompt (no chat template): [tokenizer's own BOS] [documents]
    [prompt pieces]. A text prompt is auto-segmented like a plain chat message, so blank-line-joined
    documents hit the cache; a prompt of token ids is the query as is."""
    prefix = list(tokenizer.encode("", add_special_tokens=True))  # BOS for Llama-style tokenizers, else []
    chunks = [encode(tokenizer, d + CHUNK_SEPARATOR) for d in documents if d]
    if isinstance(prompt, list):
        return Segments(prefix_ids=prefix, chunk_ids=chunks, query_ids=list(prompt))
    pieces, query = split_plain_text(prompt)
    chunks += [encode(tokenizer, p) for p in pieces]
    return Segments(prefix_ids=prefix, chunk_ids=[c for c in chunks if c], query_ids=encode(tokenizer, query))
