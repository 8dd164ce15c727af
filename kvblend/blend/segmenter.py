"""A prompt as segments: prefix (template start + system/instructions), chunks (documents), query.

Each piece is tokenized on its own, so a chunk's token ids are identical wherever it appears. The
joined string is never re-tokenized: every prefill mode sees exactly ``Segments.token_ids``.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from kvblend.blend.known_docs import KnownDocuments
from kvblend.blend.layouts import Layout, split_context

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
    """Token ids of ``text`` alone: no BOS/EOS, special tokens in the text are parsed (template
    parts)."""
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


CHUNK_IDS_CACHE_SIZE = 8192  # documents remembered per tokenizer (a few KB of ids each)
_chunk_ids: "weakref.WeakKeyDictionary[object, OrderedDict[str, tuple[int, ...]]]" = (
    weakref.WeakKeyDictionary()
)
_chunk_ids_lock = threading.Lock()
_known: "weakref.WeakKeyDictionary[object, KnownDocuments]" = weakref.WeakKeyDictionary()


def known_documents(tokenizer) -> KnownDocuments:
    """The documents cached as chunks with ``tokenizer`` (``encode_chunk`` adds them)."""
    with _chunk_ids_lock:
        return _known.setdefault(tokenizer, KnownDocuments())


def encode_chunk(tokenizer, text: str) -> list[int]:
    """``encode`` for a document's chunk text, remembered: documents come back (that is what the KV
    cache is for), and tokenizing 6k tokens of them costs more than the HTTP path around them."""
    with _chunk_ids_lock:
        cache = _chunk_ids.setdefault(tokenizer, OrderedDict())
        ids = cache.get(text)
        if ids is not None:
            cache.move_to_end(text)
            return list(ids)
    ids = tuple(encode(tokenizer, text))
    known_documents(tokenizer).add(text)
    with _chunk_ids_lock:
        cache[text] = ids
        if len(cache) > CHUNK_IDS_CACHE_SIZE:
            cache.popitem(last=False)
    return list(ids)


def render_template_halves(
    tokenizer, system: str | None, history: list[dict] | None = None
) -> tuple[str, str]:
    """The chat template rendered around the last user turn: (text before its content, text after).

    ``history`` holds earlier messages (system, user, assistant turns); they land in the first half.
    """
    messages = list(history or [])
    if system is not None:
        messages = [{"role": "system", "content": system}] + messages
    messages.append({"role": "user", "content": _MARKER})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if rendered.count(_MARKER) != 1:
        raise ValueError(
            "the chat template did not render the user content verbatim; cannot segment it"
        )
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
    """Segments for: [template start, system, history, user: instruction] [doc + sep]... [question +
    template end]."""
    return build_segments_from_parts(
        tokenizer, canonical_chunks(documents), question, system, history, leading_text=instruction
    )


def canonical_chunk(text: str) -> str:
    """The one text a document is cached as, whichever way it arrived (``documents``, a content
    part, blank-line text, a framework template, ``/v1/chunks``): stripped, then one blank line."""
    text = text.strip()
    return text + CHUNK_SEPARATOR if text else ""


def canonical_chunks(texts: list[str]) -> list[str]:
    return [c for c in map(canonical_chunk, texts) if c]


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
        pieces.append(text[pos : m.end()])
        pos = m.end()
    pieces.append(text[pos:])
    pieces = [p for p in pieces if p]
    if len(pieces) <= 1:
        return [], text
    return pieces[:-1], pieces[-1]


def build_segments_from_parts(
    tokenizer,
    chunk_texts: list[str],
    query_text: str,
    system: str | None = None,
    history: list[dict] | None = None,
    leading_text: str = "",
) -> Segments:
    """Like ``build_segments`` but chunk texts are used verbatim (no separator added)."""
    before, after = render_template_halves(tokenizer, system, history)
    return Segments(
        prefix_ids=encode(tokenizer, before + leading_text),
        chunk_ids=[ids for ids in (encode_chunk(tokenizer, t) for t in chunk_texts) if ids],
        query_ids=encode(tokenizer, query_text + after),
    )


def build_completion_segments(tokenizer, prompt: str | list[int], documents: list[str]) -> Segments:
    """Segments for a raw completion prompt (no chat template): [tokenizer's own BOS] [documents]
    [prompt pieces]. A text prompt is auto-segmented like a plain chat message, so blank-line-joined
    documents hit the cache; a prompt of token ids is the query as is."""
    prefix = list(
        tokenizer.encode("", add_special_tokens=True)
    )  # BOS for Llama-style tokenizers, else []
    if isinstance(prompt, list):
        chunks = [encode_chunk(tokenizer, c) for c in canonical_chunks(documents)]
        return Segments(prefix_ids=prefix, chunk_ids=chunks, query_ids=list(prompt))
    items = [(True, c) for c in canonical_chunks(documents)]
    items += _layout_items(_find_documents(tokenizer, prompt, "user"))
    segs = _segments_from_items(tokenizer, items, 0)  # no document: the prompt is the query
    segs.prefix_ids = prefix + segs.prefix_ids
    return segs


# --- chat messages as frameworks send them -----------------------------------------------------

_MSG_MARKER = "\ue000KVBLEND_MSG{}\ue001"


def part_text(part) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type", "text") == "text":
        return part.get("text", "") or ""
    raise ValueError("only text content parts are supported")


def content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part_text(p) for p in content)
    return str(content)


def render_template_pieces(tokenizer, roles: list[str]) -> list[str]:
    """The chat template's own text around each message's content: ``len(roles) + 1`` pieces, the
    last ending with the generation prompt."""
    marked = [{"role": r, "content": _MSG_MARKER.format(i)} for i, r in enumerate(roles)]
    rendered = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
    pieces, pos = [], 0
    for i in range(len(roles)):
        marker = _MSG_MARKER.format(i)
        if rendered.count(marker) != 1 or rendered.find(marker, pos) < 0:
            raise ValueError(
                "the chat template did not render message content verbatim; cannot segment it"
            )
        at = rendered.index(marker, pos)
        pieces.append(rendered[pos:at])
        pos = at + len(marker)
    pieces.append(rendered[pos:])
    return pieces


def build_segments_from_messages(
    tokenizer, messages: list[dict], documents: list[str] | None = None
) -> Segments:
    """OpenAI chat messages -> segments. Documents are found, in order of precedence, in:
    ``documents`` (chunks before the last user message's text); the last user message as an array
    of text parts (every part but the last is a document); the last user message's text and a
    leading system message's text, each split by ``layouts.split_context`` (framework templates,
    blank-line paragraphs). Each document becomes one chunk (``canonical_chunk``); the template's
    text before the first chunk is the prefix, after the last the query, and text between two
    chunks (a system message's end and the user's start) a chunk of its own."""
    if not messages or messages[-1].get("role") != "user":
        raise ValueError("messages must end with a user message")
    roles = ["system" if m.get("role") == "developer" else m.get("role", "user") for m in messages]
    glue = render_template_pieces(tokenizer, roles)
    items: list[tuple[bool, str]] = []  # (is a chunk, text), in prompt order
    last = len(messages) - 1
    user_start = 0
    for i, m in enumerate(messages):
        items.append((False, glue[i]))
        if i == last:
            user_start = len(items)
            items += _user_items(tokenizer, m.get("content"), documents)
        elif i == 0 and roles[0] == "system":
            system = content_text(m.get("content"))
            items += _layout_items(_find_documents(tokenizer, system, "system"))
        else:
            items.append((False, content_text(m.get("content"))))
    items.append((False, glue[-1]))
    return _segments_from_items(tokenizer, items, user_start)


def _find_documents(tokenizer, text: str, role: str) -> Layout:
    """``split_context``; where it finds at most one document, the documents already cached."""
    layout = split_context(text, role)
    if len(layout.documents) <= 1:
        known = known_documents(tokenizer).layout(text)
        if known is not None and len(known.documents) > len(layout.documents):
            return known
    return layout


def _user_items(tokenizer, content, documents: list[str] | None) -> list[tuple[bool, str]]:
    if documents:
        return [(True, c) for c in canonical_chunks(documents)] + [(False, content_text(content))]
    if isinstance(content, list) and len(content) > 1:
        parts = [t for t in map(part_text, content) if t]
        if len(parts) > 1:
            return [(True, c) for c in canonical_chunks(parts[:-1])] + [(False, parts[-1])]
        content = parts
    return _layout_items(_find_documents(tokenizer, content_text(content), "user"))


def _layout_items(layout) -> list[tuple[bool, str]]:
    items: list[tuple[bool, str]] = [(False, layout.lead)]
    for i, doc in enumerate(layout.documents):
        items.append((True, canonical_chunk(doc)))
        if i < len(layout.glue):
            items.append((False, layout.glue[i]))
    return items + [(False, layout.tail)]


def _segments_from_items(tokenizer, items: list[tuple[bool, str]], user_start: int) -> Segments:
    """Template text before the first chunk -> prefix, after the last -> query; text between two
    chunks is a chunk itself. With no chunk, the prefix ends where the last user message starts."""
    chunk_at = [i for i, (is_chunk, _) in enumerate(items) if is_chunk]
    if not chunk_at:
        return Segments(
            prefix_ids=encode(tokenizer, "".join(t for _, t in items[:user_start])),
            query_ids=encode(tokenizer, "".join(t for _, t in items[user_start:])),
        )
    first, last = chunk_at[0], chunk_at[-1]
    chunks: list[str] = []
    glue = ""
    for is_chunk, text in items[first : last + 1]:
        if is_chunk:
            if glue.strip():
                chunks.append(glue)
            chunks.append(text)
            glue = ""
        else:
            glue += text
    return Segments(
        prefix_ids=encode(tokenizer, "".join(t for _, t in items[:first])),
        chunk_ids=[ids for ids in (encode_chunk(tokenizer, c) for c in chunks) if ids],
        query_ids=encode(tokenizer, "".join(t for _, t in items[last + 1 :])),
    )
