"""`kvblend bench engine --pool`: per-example results of runs over disjoint example ranges merge
into the report one run over all of them gives (pure functions; the CLI path runs in
test_bench_engine)."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from kvblend.bench.engine_bench import ModeRun, pool_results, quality_curve, smallest_ratio


def _runs(rng: random.Random, n: int) -> list[ModeRun]:
    runs = [
        ModeRun("full", "full", 1.0),
        ModeRun("reuse", "reuse", 0.0),
        ModeRun("blend@0.15", "blend", 0.15),
    ]
    for _ in range(n):
        for mr, scale in zip(runs, (1.0, 0.03, 0.2)):
            mr.ttft_ms.append(rng.uniform(10, 20) * 1000 * scale)
            mr.f1.append(rng.choice([0.0, 0.0, 0.4, 0.5]))
            mr.first_token_agree.append(1.0 if mr.mode == "full" else float(rng.random() < 0.9))
            mr.kl_vs_full.append(0.0 if mr.mode == "full" else rng.uniform(0, 0.5))
            mr.rouge_vs_full.append(1.0 if mr.mode == "full" else rng.uniform(0.4, 1.0))
            mr.decode_ms.append(
                rng.choice([None, rng.uniform(30, 40)])
            )  # None: the answer was one token
            mr.answers.append(f"answer {len(mr.answers)}")
    return runs


def _result(runs: list[ModeRun], offset: int, **extra) -> dict:
    return {
        "bench": "engine",
        "model": "m",
        "model_dir": "/m",
        "dtype": "float32",
        "attention_kernel": "avx2",
        "check_layers": [1],
        "check_ratios": [],
        "deviation": "v",
        "max_tokens": 8,
        "threads": 2,
        "examples": len(runs[0].ttft_ms),
        "offset": offset,
        "modes": [mr.summary(runs[0]) for mr in runs],
        **extra,
    }


def _slice(runs: list[ModeRun], start: int, end: int) -> list[ModeRun]:
    out = []
    for mr in runs:
        part = ModeRun(mr.name, mr.mode, mr.ratio)
        for name in (
            "ttft_ms",
            "f1",
            "first_token_agree",
            "kl_vs_full",
            "rouge_vs_full",
            "decode_ms",
            "answers",
        ):
            setattr(part, name, getattr(mr, name)[start:end])
        out.append(part)
    return out


def test_pooled_halves_equal_the_whole(tmp_path):
    whole = _runs(random.Random(1), 9)
    paths = []
    for start, end in ((4, 9), (0, 4)):  # given out of order: pooling sorts by offset
        path = tmp_path / f"part{start}.json"
        path.write_text(
            json.dumps(
                _result(
                    _slice(whole, start, end), start, seed=0, prompt_tokens=[6000] * (end - start)
                )
            )
        )
        paths.append(str(path))
    pooled = pool_results(paths)
    expected = [mr.summary(whole[0]) for mr in whole]
    assert (
        pooled["examples"] == 9 and pooled["offset"] == 0 and pooled["prompt_tokens_median"] == 6000
    )
    assert pooled["pooled_from"] == [paths[1], paths[0]]
    # the files keep rounded per-example values (TTFT to 0.01 ms, F1 / Rouge-L to 1e-4, KL to 1e-5):
    # the pooled summaries match the whole run's to that rounding
    tolerance = {
        "ttft_median_ms": 0.01,
        "speedup_vs_full": 2e-3,
        "speedup_paired_median": 2e-3,
        "f1": 2e-4,
        "first_token_agreement": 0,
        "first_token_kl_vs_full": 2e-4,
        "rouge_l_vs_full": 2e-4,
        "decode_ms_per_token_median": 0.01,
    }
    for row, ref in zip(pooled["modes"], expected):
        assert row["n"] == ref["n"] and row["per_example"] == ref["per_example"]
        for key, tol in tolerance.items():
            assert row[key] == pytest.approx(ref[key], abs=tol), (row["name"], key)


def test_a_file_without_per_example_rouge_pools_its_weighted_mean(tmp_path):
    whole = _runs(random.Random(2), 6)
    old = _result(_slice(whole, 0, 2), 0)
    del old["offset"]  # written before --offset existed: it covers the examples from 0
    for row in old["modes"]:
        del row["per_example"]["rouge_l_vs_full"]
        del row["per_example"]["decode_ms_per_token"]  # and before decode timing
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(_result(_slice(whole, 2, 6), 2)))
    pooled = pool_results([str(tmp_path / "new.json"), str(tmp_path / "old.json")])
    for row, ref in zip(pooled["modes"], whole):
        first, rest = sum(ref.rouge_vs_full[:2]) / 2, sum(ref.rouge_vs_full[2:])
        assert row["rouge_l_vs_full"] == pytest.approx((2 * round(first, 4) + rest) / 6, abs=2e-4)
        # the old file's examples have no decode timing: the median is over the new file's
        assert row["per_example"]["decode_ms_per_token"][:2] == [None, None]
        timed = [round(d, 2) for d in ref.decode_ms[2:] if d is not None]
        assert row["decode_ms_per_token_median"] == (
            pytest.approx(statistics.median(timed), abs=0.01) if timed else None
        )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"dtype": "bfloat16"}, "differs from"),
        ({"seed": 3}, "differs from"),
        ({"offset": 2}, "overlaps an earlier file's range"),
    ],
)
def test_runs_that_cannot_pool_are_refused(tmp_path, change, message):
    runs = _runs(random.Random(3), 4)
    (tmp_path / "a.json").write_text(json.dumps(_result(runs, 0)))
    (tmp_path / "b.json").write_text(json.dumps({**_result(runs, 4), **change}))
    with pytest.raises(SystemExit, match=message):
        pool_results([str(tmp_path / "a.json"), str(tmp_path / "b.json")])


def test_not_a_bench_engine_file_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"bench": "ttft"}))
    with pytest.raises(SystemExit, match="cannot use .*x.json"):
        pool_results([str(tmp_path / "x.json")])


def test_quality_curve_orders_by_ratio_and_names_the_smallest_ratio_reaching_agreement():
    runs = _runs(random.Random(4), 5)
    runs.append(
        ModeRun(
            "blend@0.3",
            "blend",
            0.3,
            **{
                k: list(getattr(runs[0], k))
                for k in (
                    "ttft_ms",
                    "f1",
                    "first_token_agree",
                    "kl_vs_full",
                    "rouge_vs_full",
                    "answers",
                )
            },
        )
    )
    rows = [mr.summary(runs[0]) for mr in runs]
    curve = quality_curve(rows)
    assert [p["name"] for p in curve] == ["reuse", "blend@0.15", "blend@0.3", "full"]
    assert curve[-1]["f1_share_of_full"] == 1.0 and curve[2]["first_token_agreement"] == 1.0
    blend15 = rows[2]["first_token_agreement"]
    assert smallest_ratio(curve, "first_token_agreement", 0.9) == (0.15 if blend15 >= 0.9 else 0.3)
    assert smallest_ratio(curve, "first_token_agreement", 1.01) is None
