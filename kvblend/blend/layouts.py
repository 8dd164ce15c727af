"""Where the documents sit in a prompt that a RAG framework rendered from its own template.

``split_context(text, role)`` returns ``Layout(lead, documents, tail)``: the template's text before
the retrieved context, each document on its own, and the template's text after it. Layouts found:

- a context between two identical rule lines (LlamaIndex's text-QA and refine templates:
  ``---------------------`` / ``------------``);
- a context after a ``Context:`` label up to the next ``Question:`` / ``Answer:`` line (LangChain's
  classic ``rlm/rag-prompt``, Haystack's RAG prompt), or a DSPy ``[[ ## context ## ]]`` field;
- otherwise paragraphs separated by blank lines: in a user message the last paragraph is the
  question (kvblend's plain-text layout); in a system message the first paragraph is the
  instruction (LangChain's current tutorial puts the documents after it).

Inside the context, documents are separated by blank lines (by line breaks when there is none,
as Haystack's template joins them). A paragraph made only of ``key: value`` lines (LlamaIndex's
node metadata, e.g. ``file_path: ...``) belongs to the document after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# A line of one character repeated (3+ times): "-----", "=====", "*****".
_RULE = re.compile(r"^[ \t]*([-=*_~#])\1{2,}[ \t]*$", re.M)
_LABEL = re.compile(
    r"^[ \t]*(?:\[\[ ## (?:contexts?|passages|documents|sources) ## \]\][ \t]*|"
    r"(?:#+[ \t]*)?(?:retrieved |new )?"
    r"(?:context|documents|passages|sources)(?: information)?[ \t]*:[ \t]*)",
    re.I | re.M,
)
# A line that ends the context: the template's question / answer slot, or the next DSPy field.
_TRAILER = re.compile(
    r"^[ \t]*(?:\[\[ ## |(?:question|query|answer|helpful answer|refined answer|new answer|"
    r"original answer|response)[ \t]*:)",
    re.I | re.M,
)
# LlamaIndex metadata keys are lower snake_case (file_path, page_label); a capitalised "Title: text"
# line is a document (MuSiQue's passages look like that).
_META_LINE = re.compile(r"[a-z_][a-z0-9_]{0,40}: [^\n]{0,300}")
_BLANK = re.compile(r"\n[ \t]*\n\s*")


@dataclass
class Layout:
    lead: str
    documents: list[str] = field(default_factory=list)
    tail: str = ""
    # Template text between consecutive documents (DSPy's "»\n[2] «"); empty: adjacent.
    glue: list[str] = field(default_factory=list)


def split_context(text: str, role: str = "user") -> Layout:
    """The documents of one message's text and the template text around them (see module doc)."""
    for finder in (_ruled_region, _labelled_region):
        region = finder(text)
        if region is not None:
            start, end = region
            numbered = _numbered(text, start, end)
            if numbered is not None:
                return numbered
            docs = split_documents(text[start:end])
            if docs:
                return Layout(text[:start], docs, text[end:])
    return _paragraphs(text, role)


def split_documents(region: str) -> list[str]:
    """Documents of a context region: blank-line paragraphs (lines when there is no blank line),
    metadata-only paragraphs joined to the document after them. Stripped, empty ones dropped."""
    sep = _BLANK if _BLANK.search(region.strip()) else re.compile(r"\n")
    pieces = [p.strip() for p in sep.split(region)]
    pieces = [p for p in pieces if p]
    docs: list[str] = []
    pending = ""
    for i, piece in enumerate(pieces):
        following = pieces[i + 1] if i + 1 < len(pieces) else None
        joins_next = following is not None and _is_metadata(piece) and not _is_metadata(following)
        if sep is _BLANK and joins_next:
            pending += piece + "\n\n"
            continue
        docs.append(pending + piece)
        pending = ""
    if pending:
        docs.append(pending.strip())
    return docs


# DSPy's list-of-strings input field (dspy/adapters/utils.py, _format_input_list_field_value):
# "[1] «text»" a line, or "[1] «««\n    text\n»»»" when the text has line breaks.
_NUMBERED = re.compile(
    r"\[(\d+)\] (?:«««\n(?P<block>.*?)\n»»»|«(?P<line>[^\n]*)»)(?=\n\[\d+\] |\s*$)", re.S
)


def _numbered(text: str, start: int, end: int) -> Layout | None:
    """A numbered «…» list filling the region: each text a document; the numbers and quotes stay
    template text (between documents: small chunks of their own, the same in any order)."""
    region = text[start:end]
    pos, stop = len(region) - len(region.lstrip()), len(region.rstrip())
    spans: list[tuple[int, int]] = []
    while pos < stop:
        m = _NUMBERED.match(region, pos, stop)
        if m is None or int(m.group(1)) != len(spans) + 1:
            return None
        spans.append(m.span("block") if m.group("block") is not None else m.span("line"))
        pos = m.end() + 1  # the line break before the next item
    if len(spans) < 2:
        return None
    docs = [region[a:b] for a, b in spans]
    glue = [region[spans[i][1] : spans[i + 1][0]] for i in range(len(spans) - 1)]
    return Layout(text[: start + spans[0][0]], docs, text[start + spans[-1][1] :], glue)


def _is_metadata(piece: str) -> bool:
    lines = piece.split("\n")
    return len(lines) <= 8 and all(_META_LINE.fullmatch(line.strip()) for line in lines)


def _ruled_region(text: str) -> tuple[int, int] | None:
    """(start, end) between the first and the last of the longest rule line found twice or more."""
    rules: dict[str, list[re.Match]] = {}
    for m in _RULE.finditer(text):
        rules.setdefault(m.group(0).strip(), []).append(m)
    pairs = [(len(k), ms) for k, ms in rules.items() if len(ms) >= 2]
    if not pairs:
        return None
    _, ms = max(pairs, key=lambda p: p[0])
    start = ms[0].end() + 1 if text[ms[0].end() : ms[0].end() + 1] == "\n" else ms[0].end()
    return start, ms[-1].start()


def _labelled_region(text: str) -> tuple[int, int] | None:
    """(start, end) from just after a context label to the next trailer line (or the text's end)."""
    label = next((m for m in _LABEL.finditer(text) if _is_label(text, m)), None)
    if label is None:
        return None
    start = label.end()
    trailer = _TRAILER.search(text, start)
    end = trailer.start() if trailer else len(text)
    return (start, end) if text[start:end].strip() else None


def _is_label(text: str, m: re.Match) -> bool:
    """A label alone on its line ("Context:\n") or inside a paragraph ("...\nContext: {docs}"); not
    a paragraph that starts with "Context: ..." (a document titled so)."""
    line_end = text.find("\n", m.end())
    alone = not text[m.end() : line_end if line_end >= 0 else len(text)].strip()
    before = text[: m.start()]
    starts_paragraph = not before.strip() or bool(re.search(r"\n[ \t]*\n[ \t]*$", before))
    return alone or not starts_paragraph


def _paragraphs(text: str, role: str) -> Layout:
    """Blank-line paragraphs: a user message's last one is the question; a system message's first
    one is the instruction. Fewer than two paragraphs: no documents."""
    spans = []
    pos = 0
    for m in _BLANK.finditer(text):
        spans.append((pos, m.end()))
        pos = m.end()
    spans.append((pos, len(text)))
    spans = [(a, b) for a, b in spans if text[a:b].strip()]
    if len(spans) < 2 and role != "system":  # no blank line: a line a piece, the last the question
        lines = re.finditer(r"[^\n]*\n|[^\n]+$", text)
        spans = [(m.start(), m.end()) for m in lines if m.group().strip()]
    if len(spans) < 2:
        return Layout(text)
    if role == "system":
        lead_end = spans[0][1]
        return Layout(text[:lead_end], split_documents(text[lead_end:]), "")
    last = spans[-1][0]
    return Layout("", split_documents(text[:last]), text[last:])
