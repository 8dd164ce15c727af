"""Where documents sit in framework-rendered prompts (kvblend/blend/layouts.py): string tests."""

from __future__ import annotations

from kvblend.bench.data import DEFAULT_INSTRUCTION, build_prompt
from kvblend.blend.layouts import split_context, split_documents
from kvblend.blend.segmenter import canonical_chunk

DOCS = [
    "The lighthouse was built in 1874.",
    "The baker sells rye bread.",
    "The river floods in spring.",
]
CTX = "\n\n".join(DOCS)


def test_llamaindex_text_qa_rules_with_metadata():
    nodes = [f"file_path: /data/{i}.txt\n\n{d}" for i, d in enumerate(DOCS)]
    text = (
        "Context information is below.\n---------------------\n"
        + "\n\n".join(nodes)
        + "\n---------------------\nGiven the context information and not prior knowledge, "
        "answer the query.\n"
        "Query: When?\nAnswer: "
    )
    lay = split_context(text)
    assert lay.documents == nodes
    assert lay.lead.endswith("---------------------\n") and lay.tail.startswith(
        "---------------------\nGiven"
    )


def test_refine_rules_with_the_query_before_the_context():
    text = (
        f"The original query is as follows: Q?\nWe have provided an existing answer: A\n"
        f"We have the opportunity to refine...\n------------\n{CTX}\n------------\nRefined Answer: "
    )
    lay = split_context(text)
    assert lay.documents == DOCS and "Q?" in lay.lead and lay.tail.startswith("------------")


def test_markdown_rule_inside_a_document_does_not_end_the_context():
    doc = "Heading\n---\nbody text"
    text = f"Context:\n---------------------\n{DOCS[0]}\n\n{doc}\n---------------------\nQuery: q"
    assert split_context(text).documents == [DOCS[0], doc]


def test_langchain_classic_question_before_context():
    text = f"You are an assistant.\nQuestion: When? \nContext: {CTX} \nAnswer:"
    lay = split_context(text)
    assert lay.documents == DOCS and lay.lead.endswith("Context: ") and lay.tail == "Answer:"
    assert "When?" in lay.lead


def test_haystack_context_one_document_a_line():
    text = (
        "Given the following information, answer the question.\n\nContext:\n"
        + "".join(f"    {d}\n" for d in DOCS)
        + "\nQuestion: q?\nAnswer:"
    )
    lay = split_context(text)
    assert lay.documents == DOCS and lay.tail.startswith("Question: q?")


def test_system_message_first_paragraph_is_the_instruction():
    lay = split_context("You are an assistant. Be concise.\n\n" + CTX, "system")
    assert (
        lay.lead == "You are an assistant. Be concise.\n\n"
        and lay.documents == DOCS
        and lay.tail == ""
    )
    assert split_context("One paragraph only.\nSecond line.", "system").documents == []


def test_plain_user_text_last_paragraph_is_the_question():
    lay = split_context(CTX + "\n\nWhich river?")
    assert lay.documents == DOCS and lay.tail == "Which river?" and lay.lead == ""
    assert split_context("a line\nanother\nq?").documents == ["a line", "another"]
    assert split_context("Say hello.").documents == []


def test_bench_prompt_passages_titled_like_labels_or_metadata_stay_documents():
    passages = [
        "Context: a film of 1990 about a lost letter.",
        "Paris: capital of France.",
        "source: lowercase but followed by metadata-like text too",
    ]
    prompt = build_prompt(DEFAULT_INSTRUCTION, passages, "Which film?")
    lay = split_context(prompt)
    assert lay.documents == [DEFAULT_INSTRUCTION] + passages and lay.tail.startswith(
        "Question: Which film?"
    )


def test_metadata_joins_only_the_document_after_it():
    assert split_documents("file_path: a.txt\npage_label: 2\n\nBody one.\n\nBody two.") == [
        "file_path: a.txt\npage_label: 2\n\nBody one.",
        "Body two.",
    ]


def test_canonical_chunk_is_the_same_text_whichever_way():
    assert (
        canonical_chunk("  doc \n")
        == canonical_chunk("doc\n\n")
        == canonical_chunk("doc")
        == "doc\n\n"
    )
    assert canonical_chunk("   ") == ""


def _dspy_list(texts: list[str]) -> str:
    """DSPy 3.4's rendering of a list[str] input field (dspy/adapters/utils.py)."""

    def blob(t: str) -> str:
        if "\n" not in t and "«" not in t and "»" not in t:
            return f"«{t}»"
        return "«««\n    " + t.replace("\n", "\n    ") + "\n»»»"

    return "\n".join(f"[{i + 1}] {blob(t)}" for i, t in enumerate(texts))


def test_dspy_numbered_context_field():
    multi = "First line of a poem.\nSecond line."
    docs = DOCS + [multi]
    text = (
        "[[ ## context ## ]]\n" + _dspy_list(docs) + "\n\n[[ ## question ## ]]\nWhich river?\n\n"
        "Respond with the corresponding output fields, starting with the field "
        "`[[ ## answer ## ]]`."
    )
    lay = split_context(text)
    assert lay.documents[:3] == DOCS and lay.documents[3].strip() == multi.replace("\n", "\n    ")
    assert lay.lead == "[[ ## context ## ]]\n[1] «"
    assert lay.glue[:2] == ["»\n[2] «", "»\n[3] «"]
    assert lay.glue[2] == "»\n[4] «««\n"
    assert lay.tail.startswith("\n»»»\n\n[[ ## question ## ]]")
    # the same documents in another order: the same document texts, the same glue by position
    again = split_context(text.replace(_dspy_list(docs), _dspy_list(docs[::-1])))
    assert sorted(map(str.strip, again.documents)) == sorted(map(str.strip, lay.documents))


def test_known_documents_are_found_where_nothing_separates_them():
    from kvblend.blend.known_docs import KnownDocuments

    long_docs = [d + " It is a long enough document for the index." * 2 for d in DOCS]
    known = KnownDocuments()
    for d in long_docs[:2]:
        known.add(d + "\n\n")  # as encode_chunk sees it: the canonical chunk text
    glued = "Intro: " + long_docs[1] + long_docs[0] + long_docs[2] + "Which river?"
    lay = known.layout(glued)
    assert lay.documents == [long_docs[1], long_docs[0]] and lay.lead == "Intro: "
    assert lay.glue == [""] and lay.tail == long_docs[2] + "Which river?"
    assert known.layout("nothing known here " * 10) is None
    known.add("short")  # below MIN_DOCUMENT_CHARS: never indexed
    assert known.find("short " * 30) == []
