"""`kvblend bench engine` end to end on the embedded model: the real CLI in a subprocess, on MuSiQue
examples cut short (three passages of 40 words) so one run takes seconds, not minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import MUSIQUE, run_bench_engine


def _short_musique(tmp_path: Path, num_examples: int = 2) -> Path:
    items = json.loads(MUSIQUE.read_text())[:num_examples]
    for it in items:
        it["ctxs"] = [
            {"title": c["title"], "text": " ".join(c["text"].split()[:40])} for c in it["ctxs"][:3]
        ]
    path = tmp_path / "musique_short.json"
    path.write_text(json.dumps(items))
    return path


def test_bench_engine_modes_ratios_and_json(tmp_path):
    out, data = tmp_path / "engine.json", _short_musique(tmp_path)
    proc = run_bench_engine(
        "--examples",
        "2",
        "--data",
        str(data),
        "--modes",
        "full,reuse,blend",
        "--ratios",
        "0,1",
        "--selection",
        "deviation,query",
        "--max-tokens",
        "6",
        "--dtype",
        "float32",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["modes"]}
    # prefix was not asked for; each ratio runs with both token selections
    assert list(rows) == ["full", "reuse", "blend@0", "blend@0/query", "blend@1", "blend@1/query"]
    assert [rows[n]["selection"] for n in ("reuse", "blend@0", "blend@0/query")] == [
        None,
        "deviation",
        "query",
    ]
    assert result["examples"] == 2 and result["dtype"] == "float32"
    assert all(r["n"] == 2 and r["ttft_median_ms"] > 0 for r in rows.values())
    per_example = rows["blend@0"]["per_example"]
    assert all(len(per_example[k]) == 2 for k in ("ttft_ms", "f1", "first_token_agree", "answers"))
    assert (
        sorted(per_example["ttft_ms"])[0]
        <= rows["blend@0"]["ttft_median_ms"]
        <= sorted(per_example["ttft_ms"])[1]
    )
    # blend@1 recomputes every chunk token: the same first token and greedy text as full prefill
    for name in ("blend@1", "blend@1/query"):
        assert rows[name]["first_token_agreement"] == 1.0 and rows[name]["rouge_l_vs_full"] == 1.0
        assert rows[name]["first_token_kl_vs_full"] <= 1e-4  # fp32: the same logits as full prefill
    assert rows["full"]["speedup_vs_full"] == 1.0 and rows["full"]["first_token_kl_vs_full"] == 0.0
    assert rows["reuse"]["first_token_kl_vs_full"] > rows["blend@1"]["first_token_kl_vs_full"]
    assert "| blend@0 |" in proc.stdout and f"wrote {out}" in proc.stdout
    # decoding after the first token is timed per mode (a step that samples EOS
    # counts, it costs a step)
    decode = [
        d for r in rows.values() for d in r["per_example"]["decode_ms_per_token"] if d is not None
    ]
    assert decode and all(d > 0 for d in decode)
    assert all(
        r["decode_ms_per_token_median"] is None or r["decode_ms_per_token_median"] > 0
        for r in rows.values()
    )
    assert "decoding after the first token, median ms a token: full " in proc.stdout
    # the quality-vs-ratio curve: reuse at 0, blend ratios, full at 1; blend@1 reaches 90% agreement
    curve = result["quality_vs_ratio"]
    assert [(p["name"], p["ratio"]) for p in curve] == [
        ("blend@0", 0.0),
        ("blend@0/query", 0.0),
        ("reuse", 0.0),
        ("blend@1", 1.0),
        ("blend@1/query", 1.0),
        ("full", 1.0),
    ]
    assert (
        curve[-1]["f1_share_of_full"] in (None, 1.0) and curve[-1]["first_token_agreement"] == 1.0
    )
    expected_smallest = 0.0 if rows["blend@0"]["first_token_agreement"] >= 0.9 else 1.0
    assert result["smallest_ratio_agreement_90"] == expected_smallest
    expected_query = 0.0 if rows["blend@0/query"]["first_token_agreement"] >= 0.9 else 1.0
    assert result["smallest_ratio_agreement_90_by_selection"] == {
        "deviation": expected_smallest,
        "query": expected_query,
    }
    assert "smallest recompute ratio reaching 90% first-token agreement" in proc.stdout
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in proc.stdout

    # --offset: each example alone, in the passage order the two-example run gave it; --pool merges
    # them into what that run reported (TTFT aside, which is measured anew)
    halves = []
    for offset in (0, 1):
        half = tmp_path / f"engine-{offset}.json"
        proc = run_bench_engine(
            "--examples",
            "1",
            "--offset",
            str(offset),
            "--data",
            str(data),
            "--modes",
            "full,reuse,blend",
            "--ratios",
            "0,1",
            "--selection",
            "deviation,query",
            "--max-tokens",
            "6",
            "--dtype",
            "float32",
            "--no-plot",
            "--out",
            str(half),
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert not half.with_suffix(".png").exists()
        halves.append(half)
    second = json.loads(halves[1].read_text())
    assert second["examples"] == 1 and second["offset"] == 1
    assert (
        second["modes"][0]["per_example"]["answers"] == rows["full"]["per_example"]["answers"][1:]
    )
    pooled_path = tmp_path / "pooled.json"
    proc = run_bench_engine(
        "--pool", str(halves[1]), str(halves[0]), "--no-plot", "--out", str(pooled_path)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    pooled = json.loads(pooled_path.read_text())
    assert pooled["examples"] == 2 and pooled["pooled_from"] == [str(halves[0]), str(halves[1])]
    for row in pooled["modes"]:
        ref = rows[row["name"]]
        assert row["per_example"]["answers"] == ref["per_example"]["answers"]
        for key in ("f1", "first_token_agreement", "rouge_l_vs_full"):
            assert row[key] == ref[key], (row["name"], key)
        assert abs(row["first_token_kl_vs_full"] - ref["first_token_kl_vs_full"]) <= 1e-4
    proc = run_bench_engine(
        "--pool", str(out), str(halves[1]), "--no-plot", "--out", str(tmp_path / "bad.json")
    )
    assert proc.returncode != 0 and "overlaps an earlier file's range" in proc.stderr


def test_bench_engine_rejects_an_unknown_mode(tmp_path):
    proc = run_bench_engine(
        "--examples", "1", "--modes", "full,fast", "--out", str(tmp_path / "x.json")
    )
    assert proc.returncode != 0
    assert "unknown mode(s) fast" in proc.stderr
    assert not (tmp_path / "x.json").exists()
    proc = run_bench_engine(
        "--examples", "1", "--selection", "deviation,best", "--out", str(tmp_path / "x.json")
    )
    assert proc.returncode != 0
    assert (
        "unknown --selection best (choose from deviation, query, lookahead, or lookahead:N)"
        in proc.stderr
    )
    assert not (tmp_path / "x.json").exists()
    proc = run_bench_engine(
        "--examples",
        "1",
        "--selection",
        "lookahead:4,deviation:2,lookahead:-1",
        "--out",
        str(tmp_path / "x.json"),
    )
    assert proc.returncode != 0 and "unknown --selection deviation:2, lookahead:-1 (" in proc.stderr


def test_bench_engine_rejects_an_offset_past_the_data(tmp_path):
    proc = run_bench_engine(
        "--examples",
        "1",
        "--offset",
        "2",
        "--data",
        str(_short_musique(tmp_path)),
        "--out",
        str(tmp_path / "x.json"),
    )
    assert proc.returncode != 0
    assert "--offset 2 skips all 2 examples" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_generate_takes_a_lookahead_depth_and_names_a_bad_one():
    """`generate --selection` spells selections as `bench engine` does (lookahead:8); a bad one is
    an argparse error naming what is accepted, before any model loads."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvblend.cli",
            "generate",
            "--question",
            "hi",
            "--selection",
            "lookahead:x",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "lookahead's layer count must be a whole number" in proc.stderr.strip().splitlines()[-1]


def test_model_and_device_errors_are_one_line(tmp_path):
    """A device that is not there (cuda:7: no CUDA on a CPU-only build, too few GPUs
    elsewhere), a malformed device and a missing model path each end the CLI with one line, no
    traceback and no JSON."""
    out = tmp_path / "x.json"
    cases = [
        (
            run_bench_engine("--examples", "1", "--device", "cuda:7", "--out", str(out)),
            ("CUDA is not available to this PyTorch", "this machine has"),
        ),
        (
            run_bench_engine("--examples", "1", "--device", "gpu", "--out", str(out)),
            ("device must be cpu, cuda or cuda:N, got 'gpu'",),
        ),
        (
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kvblend.cli",
                    "generate",
                    "--model",
                    str(tmp_path / "none.gguf"),
                    "--question",
                    "hi",
                ],
                capture_output=True,
                text=True,
                timeout=600,
            ),
            ("does not exist (model hubs are not reachable",),
        ),
    ]
    for proc, messages in cases:
        assert proc.returncode == 2, proc.stderr
        assert any(m in proc.stderr for m in messages), proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, (
            proc.stderr
        )
    assert not out.exists()


def test_policies_name_the_rows_to_run_after_full():
    import pytest

    from kvblend.bench.engine_bench import _policy_runs

    runs = _policy_runs("reuse, blend@0.15, blend@0.3/lookahead:8, full, blend@0.15")
    assert [(r.name, r.mode, r.ratio, r.selection) for r in runs] == [
        ("full", "full", 1.0, None),
        ("reuse", "reuse", 0.0, None),
        ("blend@0.15", "blend", 0.15, "deviation"),
        ("blend@0.3/lookahead:8", "blend", 0.3, "lookahead:8"),
    ]
    for bad in ("blend", "blend@2", "fast"):
        with pytest.raises(SystemExit, match="--policies"):
            _policy_runs(bad)
