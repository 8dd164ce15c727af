"""`kvblend calibrate`: measure blend settings against full prefill and write the
model's calibration.

For each prompt (built as `kvblend bench engine` builds them, passages shuffled), full prefill and
every (selection, ratio) run one token each; first-token agreement, KL and the paired TTFT
speed-up per setting go to the calibration file (kvblend/engine/fidelity.py), which `serve` and
the engine read to meet a ``fidelity`` target. Run it on prompts like the traffic's: agreement
depends on the data.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

DEFAULT_RATIOS = "0.1,0.15,0.3,0.5"
DEFAULT_SELECTIONS = "deviation,lookahead"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="", help="HF dir or .gguf (default: embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument(
        "--data", default="musique", help="musique (default), hotpotqa or a .json / .jsonl path"
    )
    p.add_argument("--examples", type=int, default=12, help="prompts (default 12)")
    p.add_argument(
        "--ratios", default=DEFAULT_RATIOS, help=f"blend ratios (default {DEFAULT_RATIOS})"
    )
    p.add_argument(
        "--selections",
        default=DEFAULT_SELECTIONS,
        help=f"token selections (default {DEFAULT_SELECTIONS}; lookahead:N allowed)",
    )
    p.add_argument(
        "--targets", default="0.8,0.9,0.95", help="fidelity targets to show the choice for"
    )
    p.add_argument("--seed", type=int, default=0, help="passage shuffle seed")
    p.add_argument(
        "--from-bench",
        default=None,
        metavar="JSON",
        help="measure nothing: take the blend rows of a `kvblend bench engine` result (same model "
        "and dtype) as the calibration",
    )
    p.add_argument(
        "--out",
        default=None,
        help="calibration JSON (default: the one the engine reads, "
        "<cache_dir>/calibration/<weights>-<dtype>.json)",
    )


class _Tally:
    def __init__(self):
        self.agree: list[float] = []
        self.kl: list[float] = []
        self.speedup: list[float] = []


def run(args) -> int:
    from kvblend.bench.data import load_examples
    from kvblend.bench.engine_bench import bench_segments, first_token_kl
    from kvblend.config import EngineConfig, ModelConfig, validate_fidelity
    from kvblend.engine.engine import create_engine
    from kvblend.engine.fidelity import Calibration, CalibrationPoint
    from kvblend.engine.request import GenerationRequest, SamplingParams
    from kvblend.policy import parse_selection, validate_ratio
    from kvblend.store.memory import MemoryStore

    try:
        ratios = [validate_ratio(float(r)) for r in args.ratios.split(",") if r.strip()]
        selections = [s.strip() for s in args.selections.split(",") if s.strip()]
        for s in selections:
            parse_selection(s)
        targets = [validate_fidelity(float(t)) for t in args.targets.split(",") if t.strip()]
        examples = load_examples(args.data, limit=args.examples)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvblend calibrate: {e}", file=sys.stderr)
        return 2
    if args.examples < 1 or not ratios or not selections:
        print("kvblend calibrate: need --examples >= 1, a ratio and a selection", file=sys.stderr)
        return 2
    engine = create_engine(
        EngineConfig(
            model=ModelConfig(
                model=args.model, dtype=args.dtype, device=args.device, num_threads=args.threads
            )
        )
    )
    if args.from_bench:
        return _save(engine, bench_calibration(engine, args.from_bench), args.out, targets)
    tallies = {(s, r): _Tally() for s in selections for r in ratios}
    rng, one = random.Random(args.seed), SamplingParams(max_tokens=1)
    for index, ex in enumerate(examples):
        shuffled = list(ex.passages)
        rng.shuffle(shuffled)
        engine.store = MemoryStore()  # bounded memory; every prompt starts cold, chunks precomputed
        segs = bench_segments(engine, shuffled, ex.question)
        engine.precompute(segs.chunk_ids)
        full = engine.run(GenerationRequest(segs, one, mode="full"))
        for (sel, ratio), tally in tallies.items():
            kind, depth = parse_selection(sel)
            res = engine.run(
                GenerationRequest(
                    segs,
                    one,
                    mode="blend",
                    recompute_ratio=ratio,
                    selection=kind,
                    lookahead_layers=depth,
                )
            )
            tally.agree.append(
                float(int(res.first_token_logits.argmax()) == int(full.first_token_logits.argmax()))
            )
            tally.kl.append(first_token_kl(full.first_token_logits, res.first_token_logits))
            tally.speedup.append(full.stats.ttft_ms / max(res.stats.ttft_ms, 1e-6))
        print(
            f"[{index + 1}/{len(examples)}] {segs.num_tokens} tokens, full "
            f"{full.stats.ttft_ms:.0f} ms",
            file=sys.stderr,
            flush=True,
        )
    points = [
        CalibrationPoint(
            sel,
            ratio,
            len(t.agree),
            round(statistics.fmean(t.agree), 4),
            round(statistics.fmean(t.kl), 5),
            round(statistics.median(t.speedup), 3),
        )
        for (sel, ratio), t in tallies.items()
    ]
    cal = Calibration(
        engine.model_id, engine.fingerprint, engine.config.model.dtype, args.data, points
    )
    return _save(engine, cal, args.out, targets)


def _save(engine, cal, out: str | None, targets: list[float]) -> int:
    from kvblend.engine.fidelity import FidelityController

    path = Path(out) if out else engine.calibration_path
    cal.save(path)
    print(render(cal, targets, FidelityController(cal)))
    print(f"\nwrote {path}")
    return 0


def bench_calibration(engine, path: str):
    """A calibration from a `bench engine` JSON's blend rows (its model and dtype must
    be the engine's)."""
    import json

    from kvblend.engine.fidelity import Calibration, CalibrationPoint

    result = json.loads(Path(path).read_text())
    if result.get("model") != engine.model_id or result.get("dtype") != engine.config.model.dtype:
        raise SystemExit(
            f"kvblend calibrate: {path} is {result.get('model')} {result.get('dtype')}, "
            f"not {engine.model_id} {engine.config.model.dtype}"
        )
    points = [
        CalibrationPoint(
            row.get("selection") or "deviation",
            row["ratio"],
            row["n"],
            row["first_token_agreement"],
            row["first_token_kl_vs_full"],
            row["speedup_paired_median"],
        )
        for row in result["modes"]
        if row["mode"] == "blend"
    ]
    if not points:
        raise SystemExit(f"kvblend calibrate: {path} has no blend rows")
    return Calibration(
        engine.model_id,
        engine.fingerprint,
        engine.config.model.dtype,
        str(result.get("data") or "musique"),
        points,
    )


def render(cal, targets: list[float], controller) -> str:
    lines = [
        f"{cal.model_id} {cal.dtype}, {cal.data}, {cal.points[0].n} prompts\n",
        "| setting | agreement | KL | paired speed-up |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {p.key} | {p.agreement:.0%} | {p.kl:.3f} | {p.speedup:.2f}x |" for p in cal.points
    ]
    lines.append("")
    for t in targets:
        s = controller.choose(t)
        what = f"{s.mode}" + (f"@{s.ratio:g}/{s.selection}" if s.mode == "blend" else "")
        lines.append(f"fidelity {t:g} -> {what} ({s.source})")
    return "\n".join(lines)
