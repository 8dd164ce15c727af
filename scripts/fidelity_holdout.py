"""Does a fidelity target hold on prompts the calibration never saw? (issue 28)

    .venv/bin/python scripts/fidelity_holdout.py bench/results/engine-<model>-<dtype>-<data>.json \
        --targets 0.7,0.8,0.9 --out bench/results/fidelity-holdout-<model>-<data>.json

From one `kvblend bench engine` result (per-prompt first-token agreement and TTFTs of every blend
row against the same full prefill), k-fold: the calibration is built from k-1 folds of prompts
exactly as `kvblend calibrate --from-bench` builds it, `FidelityController.choose` (the engine's
own chooser) picks the setting for each target, and that setting is scored on the held-out fold:
its first-token agreement and paired TTFT speed-up there (full prefill: 1.0 and 1x). No model
runs: the numbers come from the bench's per-prompt records.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvblend.engine.fidelity import (  # noqa: E402
    Calibration,
    CalibrationPoint,
    FidelityController,
)


def blend_rows(result: dict) -> tuple[list[float], list[dict]]:
    """Full prefill's per-prompt TTFTs, and the blend rows with per-prompt records."""
    full = next(r for r in result["modes"] if r["mode"] == "full")
    rows = [r for r in result["modes"] if r["mode"] == "blend"]
    return full["per_example"]["ttft_ms"], rows


def point(row: dict, full_ttft: list[float], prompts: list[int]) -> CalibrationPoint:
    pe = row["per_example"]
    paired = [full_ttft[i] / pe["ttft_ms"][i] for i in prompts if pe["ttft_ms"][i] > 0]
    return CalibrationPoint(
        row.get("selection") or "deviation",
        row["ratio"],
        len(prompts),
        statistics.fmean(pe["first_token_agree"][i] for i in prompts),
        statistics.fmean(pe["first_token_kl_vs_full"][i] for i in prompts),
        statistics.median(paired) if paired else None,
    )


def holdout(result: dict, targets: list[float], num_folds: int) -> list[dict]:
    full_ttft, rows = blend_rows(result)
    num_prompts = len(full_ttft)
    folds = [list(range(f, num_prompts, num_folds)) for f in range(num_folds)]
    out = []
    for target in targets:
        agree, kept, speed, chosen = [], [], [], []
        for held in folds:
            fit = [i for i in range(num_prompts) if i not in held]
            cal = Calibration(result["model"], "", result["dtype"], str(result.get("data")), [])
            cal.points = [point(r, full_ttft, fit) for r in rows]
            setting = FidelityController(cal).choose(target)
            chosen.append(
                {
                    "mode": setting.mode,
                    "ratio": setting.ratio,
                    "selection": setting.selection,
                    "expected": setting.expected_agreement,
                    "source": setting.source,
                }
            )
            if setting.mode == "full":
                agree += [1.0] * len(held)
                speed += [1.0] * len(held)
                continue
            row = next(
                r
                for r in rows
                if r["ratio"] == setting.ratio
                and (r.get("selection") or "deviation") == setting.selection
            )
            pe = row["per_example"]
            agree += [pe["first_token_agree"][i] for i in held]
            speed += [full_ttft[i] / pe["ttft_ms"][i] for i in held]
            kept += held
        out.append(
            {
                "target": target,
                "heldout_agreement": round(statistics.fmean(agree), 4),
                "heldout_speedup_median": round(statistics.median(speed), 3),
                "prompts_blended": len(kept),
                "folds": chosen,
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    ap.add_argument("--targets", default="0.6,0.7,0.8,0.9")
    ap.add_argument("--folds", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    result = json.loads(Path(args.bench_json).read_text())
    targets = [float(t) for t in args.targets.split(",") if t.strip()]
    table = holdout(result, targets, args.folds)
    for row in table:
        picks = ", ".join(
            f"{c['mode']}" + (f"@{c['ratio']:g}/{c['selection']}" if c["mode"] == "blend" else "")
            for c in row["folds"]
        )
        print(
            f"target {row['target']:g}: held-out agreement {row['heldout_agreement']:.0%}, "
            f"speed-up {row['heldout_speedup_median']:.2f}x ({picks})"
        )
    if args.out:
        doc = {
            "script": "fidelity_holdout",
            "source": Path(args.bench_json).name,
            "model": result["model"],
            "dtype": result["dtype"],
            "data": result.get("data") or "musique",
            "examples": result["examples"],
            "folds": args.folds,
            "targets": table,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
