"""Answer-quality and latency statistics shared by eval, bench ttft and bench load.

F1 / EM follow the SQuAD evaluation script (as the CacheBlend paper scores MuSiQue): lower-case,
drop punctuation and the articles a/an/the, collapse whitespace, then token-overlap F1, max over
gold answers. Rouge-L is rouge-score's LCS F-measure.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from dataclasses import asdict, dataclass

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)  # both empty counts as a match, as in SQuAD v2
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def max_over_golds(metric, prediction: str, golds: list[str]) -> float:
    return max((metric(prediction, g) for g in golds), default=0.0)


def rouge_l(prediction: str, reference: str) -> float:
    """Rouge-L F-measure; rouge-score tokenizes on alphanumerics, lower-cased, without stemming."""
    from rouge_score import rouge_scorer

    return (
        rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
        .score(reference, prediction)["rougeL"]
        .fmeasure
    )


def clean_answer(text: str) -> str:
    """The answer part of a generation: first non-empty line, without a leading 'Answer:' label."""
    for line in text.strip().splitlines():
        line = line.strip()
        if line:
            return re.sub(r"^(answer\s*:\s*)", "", line, flags=re.IGNORECASE).strip()
    return ""


@dataclass
class Summary:
    n: int
    mean: float | None
    p50: float | None
    p95: float | None
    min: float | None
    max: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: list[float]) -> Summary:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return Summary(0, None, None, None, None, None)
    return Summary(
        len(vals),
        sum(vals) / len(vals),
        percentile(vals, 50),
        percentile(vals, 95),
        vals[0],
        vals[-1],
    )
