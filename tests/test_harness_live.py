"""The harness CLIs against a live `kvblend serve` (real model), as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

KEY = "sk-live-harness-0123"
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def live(kvblend_server_factory):
    return kvblend_server_factory(
        config={"api_keys": [KEY], "models": [{"id": MODEL, "model": "", "dtype": "auto"}]}
    )


def _auth(tmp_path: Path, live, **over) -> Path:
    cfg = {
        "base_url": live.base_url + "/v1",
        "api_key": KEY,
        "model_id": MODEL,
        "timeout": 300,
        "max_retries": 0,
    }
    cfg.update(over)
    path = tmp_path / "auth.json"
    path.write_text(json.dumps(cfg))
    return path


def _kvblend(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvblend.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_doctor_against_live_server(live, tmp_path):
    ok = _kvblend("doctor", "--auth", str(_auth(tmp_path, live)), cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.count("PASS") == 6, ok.stdout + ok.stderr
    wrong = _kvblend(
        "doctor", "--auth", str(_auth(tmp_path, live, api_key="sk-nope-999999")), cwd=tmp_path
    )
    key_line = next(ln for ln in wrong.stdout.splitlines() if "key accepted" in ln)
    assert wrong.returncode == 1 and key_line.startswith("FAIL") and "401" in key_line
    unknown = _kvblend(
        "doctor", "--auth", str(_auth(tmp_path, live, model_id="gpt-9")), cwd=tmp_path
    )
    model_line = next(ln for ln in unknown.stdout.splitlines() if "model id exists" in ln)
    assert unknown.returncode == 1 and MODEL in model_line


def test_bench_ttft_and_eval_against_live_server(live, tmp_path):
    auth = str(_auth(tmp_path, live))
    out = tmp_path / "results"
    r = _kvblend(
        "bench",
        "ttft",
        "--auth",
        auth,
        "--rounds",
        "1",
        "--docs",
        "2",
        "--max-tokens",
        "2",
        "--no-plot",
        "--out-dir",
        str(out),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    (ep,) = json.loads(next(out.glob("ttft-*.json")).read_text())["endpoints"]
    share = {name: s["cached_share"] for name, s in ep["scenarios"].items()}
    assert share["prefix_hit"] > 0.5 and share["shuffled"] > 0.5  # chunks reused in any order
    assert share["full_recompute"] < 0.2  # only the chat template's opening can hit
    r = _kvblend(
        "eval",
        "--auth",
        auth,
        "--limit",
        "3",
        "--docs",
        "2",
        "--max-tokens",
        "4",
        "--modes",
        "full,blend@0.15",
        "--no-plot",
        "--out-dir",
        str(out),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    modes = json.loads(next(out.glob("eval-*.json")).read_text())["endpoints"][0]["modes"]
    assert modes["full"]["agree_em"] == 1.0
    assert all(m["f1"] is not None and m["ttft_ms"]["n"] == 3 for m in modes.values())
