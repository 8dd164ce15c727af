"""The incremental detokenizer against the full re-decode it replaced (real tokenizers: the
embedded SmolLM2's and, where fetched, Qwen2.5's)."""

from __future__ import annotations

import os
import random
from functools import lru_cache
from pathlib import Path

import pytest

from kvblend.config import ModelConfig
from kvblend.engine.detokenizer import Detokenizer, partial_suffix

QWEN = Path(os.path.expanduser("~/.cache/kvblend/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
TEXTS = [
    "Hello, world! The answer is 42.",
    "naïve café — déjà vu; Ελληνικά and русский текст",
    "世界你好，这是一个测试。日本語のテキストも。한국어 문장",
    "emoji 😀🎉👍🏽 and flags 🇫🇷🇯🇵 family 👨‍👩‍👧",
    "code:\n    def f(x):\n        return x ** 2  # ✓\n\n\tdone",
    "  leading spaces and trailing   ",
    "###stop### then more ### text",
]


@lru_cache(maxsize=None)
def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from kvblend.models.loader import resolve_model_dir

    if name == "qwen":
        if not QWEN.is_file():
            pytest.skip(f"{QWEN} missing: run `make qwen`")
        return AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig(model=str(QWEN))))
    return AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig()))


TOKENIZERS = ["smollm2", "qwen"]


def _reference(tokenizer, ids: list[int], stop: list[str], max_tokens: int):
    """The engine's detokenization before the detokenizer: the whole text decoded every token."""
    text, deltas, stopped = "", [], False
    for n in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        hold = 0
        for s in stop:
            at = full.find(s)
            if s and at != -1:
                full, stopped = full[:at], True
                break
            hold = max(hold, partial_suffix(full, s))
        if not stopped and n >= max_tokens:
            hold = 0
        if not stopped and n < max_tokens and full.endswith("\ufffd"):
            hold = max(hold, 1)
        visible = full[: len(full) - hold] if hold else full
        delta = visible[len(text) :] if visible.startswith(text) else ""
        text += delta
        deltas.append(delta)
        if stopped:
            break
    return deltas, stopped


def _run(tokenizer, ids: list[int], stop: list[str], max_tokens: int):
    detok, deltas = Detokenizer(tokenizer, stop), []
    for n, token_id in enumerate(ids, 1):
        deltas.append(detok.add(token_id, n >= max_tokens))
        if detok.stopped:
            break
    assert "".join(deltas) == detok.text
    return deltas, detok.stopped


def _check(tokenizer, ids: list[int], stop: list[str] = (), max_tokens: int | None = None):
    max_tokens = max_tokens or len(ids)
    ids = ids[:max_tokens]  # the engine samples no more
    got = _run(tokenizer, ids, list(stop), max_tokens)
    assert got == _reference(tokenizer, ids, list(stop), max_tokens)
    return got


@pytest.mark.parametrize("name", TOKENIZERS)
def test_fast_tokenizers_decode_incrementally(name):
    assert Detokenizer(_tokenizer(name)).incremental


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_whole_decode(name, text):
    tok = _tokenizer(name)
    ids = tok.encode(text, add_special_tokens=False)
    deltas, stopped = _check(tok, ids)
    assert not stopped
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("name", TOKENIZERS)
def test_random_token_sequences_match_the_full_decode(name):
    """Arbitrary ids split UTF-8 characters anywhere, even never completing them."""
    tok = _tokenizer(name)
    rng = random.Random(0)
    pool = sorted({i for t in TEXTS for i in tok.encode(t, add_special_tokens=False)})
    for _ in range(60):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        deltas, _ = _check(tok, ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    for _ in range(20):  # any vocabulary id, byte tokens included
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        _check(tok, ids)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_partial_character_is_held_until_complete(name):
    tok = _tokenizer(name)
    ids = tok.encode("a 😀 b 世界", add_special_tokens=False)
    deltas, _ = _check(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    # cut short inside the emoji: the last token flushes what is there, replacement char and all
    for n in range(1, len(ids) + 1):
        _check(tok, ids[:n], max_tokens=n)


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize(
    "text, stop",
    [
        ("The answer is Paris.\nQuestion: next", ["\nQuestion:"]),
        ("one two three four", ["o thr"]),  # across token boundaries
        ("###stop### then more", ["###"]),  # at the very start: nothing is emitted
        ("alpha beta gamma", ["zeta", "beta", "alpha beta"]),  # the first listed stop found wins
        ("no stop here at all", ["STOP", "here!"]),  # a held partial match released
        ("emoji 😀 end", ["😀"]),  # a multi-byte stop
        ("世界你好世界", ["你好"]),
    ],
)
def test_stop_strings_cut_as_before(name, text, stop):
    tok = _tokenizer(name)
    ids = tok.encode(text, add_special_tokens=False)
    deltas, stopped = _check(tok, ids, stop)
    full = tok.decode(ids, skip_special_tokens=True)
    found = [s for s in stop if s in full]
    assert stopped == bool(found)
    if found:  # a stop that ends just before an incomplete character was partly emitted already
        cut = full[: full.find(found[0])]  # (the engine always did this: kept as it was)
        assert "".join(deltas) == cut or "你好" in stop
    for n in range(1, len(ids) + 1):  # cut short anywhere: the held-back tail as before
        _check(tok, ids, stop, max_tokens=n)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_special_tokens_are_skipped(name):
    tok = _tokenizer(name)
    special = [i for i in tok.all_special_ids if i is not None]
    assert special
    ids = tok.encode("Hi there", add_special_tokens=False)
    ids = [special[0]] + ids[:1] + special + ids[1:] + [special[-1]]
    deltas, _ = _check(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "Hi there"


def test_a_tokenizer_without_a_backend_decodes_in_full():
    class Words:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(f"w{i}" for i in ids)

    detok = Detokenizer(Words(), ["w3"])
    assert not detok.incremental
    assert [detok.add(i) for i in (1, 2)] == ["w1", " w2"]
    assert detok.add(3) == " " and detok.stopped and detok.text == "w1 w2 "


def test_partial_suffix():
    assert partial_suffix("abc##", "###") == 2
    assert partial_suffix("abc", "###") == 0
    assert partial_suffix("abc", "") == 0
