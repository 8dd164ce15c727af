"""`kvblend bench engine`: TTFT and quality of every prefill mode, in-process, on MuSiQue.

Per example: chunks are precomputed and the prefix cache is warmed with the passages in their original
order (untimed); then every mode prefills the *shuffled* order, as a RAG request with re-ranked chunks
would arrive. Reported per mode: median TTFT and its ratio to `full`, SQuAD F1 against the gold answers,
first-token agreement and greedy Rouge-L against `full`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_RATIOS = (0.05, 0.15, 0.30)
MODES = ("full", "prefix", "reuse", "blend")


@dataclass
class ModeRun:
    name: str  # "full", "prefix", "reuse", "blend@0.15"
    mode: str
    ratio: float
    ttft_ms: list[float] = field(default_factory=list)
    f1: list[float] = field(default_factory=list)
    first_token_agree: list[float] = field(default_factory=list)
    rouge_vs_full: list[float] = field(default_factory=list)
    kl_vs_full: list[float] = field(default_factory=list)  # KL(full || mode) of the first-token distribution
    answers: list[str] = field(default_factory=list)

    def summary(self, full: "ModeRun") -> dict:
        med = statistics.median(self.ttft_ms) if self.ttft_ms else float("nan")
        full_med = statistics.median(full.ttft_ms) if full.ttft_ms else None
        # Per example, full and this mode ran seconds apart: the median of those ratios is robust to a
        # shared machine's speed drifting over the run, which moves both medians.
        paired = [f / t for f, t in zip(full.ttft_ms, self.ttft_ms) if t > 0]
        return {
            "name": self.name, "mode": self.mode, "ratio": self.ratio, "n": len(self.ttft_ms),
            "ttft_median_ms": round(med, 2),
            "speedup_vs_full": round(full_med / med, 3) if full_med and med else None,
            "speedup_paired_median": round(statistics.median(paired), 3) if paired else None,
            "f1": round(statistics.fmean(self.f1), 4) if self.f1 else None,
            "first_token_agreement": round(statistics.fmean(self.first_token_agree), 4) if self.first_token_agree else None,
            "rouge_l_vs_full": round(statistics.fmean(self.rouge_vs_full), 4) if self.rouge_vs_full else None,
            "first_token_kl_vs_full": round(statistics.fmean(self.kl_vs_full), 4) if self.kl_vs_full else None,
            # one entry per example, in run order: paired comparisons and spreads, not only the means
            "per_example": {"ttft_ms": [round(t, 2) for t in self.ttft_ms], "f1": [round(f, 4) for f in self.f1],
                            "first_token_agree": self.first_token_agree,
                            "first_token_kl_vs_full": [round(k, 5) for k in self.kl_vs_full],
                            "answers": self.answers},
        }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--examples", type=int, default=10, help="number of MuSiQue examples (default 10)")
    p.add_argument("--data", default=None, help="MuSiQue JSON (default ../shared/data/musique_dev.json)")
    p.add_argument("--model", default="", help="HF dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto (default): bfloat16 where this CPU has native bf16 (AMX / AVX-512 BF16), else float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--attention-kernel", default=None, choices=["auto", "amx", "avx2", "torch"],
                   help="prefill attention: auto (the native kernel for the dtype where it applies: amx for "
                        "bfloat16, avx2 for float32), amx / avx2 (required), torch "
                        "(default: KVBLEND_ATTENTION_KERNEL or auto)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated modes to run (default all: full,prefix,reuse,blend); full always "
                        "runs, it is the reference")
    p.add_argument("--ratios", default=",".join(map(str, DEFAULT_RATIOS)),
                   help="comma-separated blend recompute ratios (default 0.05,0.15,0.3)")
    p.add_argument("--check-layers", default="1", help="comma-separated check layers (gradual filtering if >1)")
    p.add_argument("--check-ratios", default="", help="ratios for the check layers (last = each --ratios value)")
    p.add_argument("--deviation", default="v", choices=["v", "k", "kv"])
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per answer (default 32)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/engine-<model>-<dtype>.json)")


def run(args) -> int:
    from kvblend.bench.data import DEFAULT_INSTRUCTION, DEFAULT_MUSIQUE, load_musique
    from kvblend.bench.metrics import clean_answer, f1_score, max_over_golds, rouge_l
    from kvblend.config import BlendConfig, EngineConfig, ModelConfig
    from kvblend.engine.engine import create_engine
    from kvblend.engine.request import GenerationRequest, SamplingParams
    from kvblend.store.memory import MemoryStore

    ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"kvblend bench engine: unknown mode(s) {', '.join(unknown)} (choose from {', '.join(MODES)})")
    blend_cfg = BlendConfig(check_layers=tuple(int(x) for x in args.check_layers.split(",")),
                            check_ratios=tuple(float(x) for x in args.check_ratios.split(",") if x.strip()),
                            deviation=args.deviation)
    model_kwargs = {"attention_kernel": args.attention_kernel} if args.attention_kernel else {}
    cfg = EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype, num_threads=args.threads, **model_kwargs),
                       blend=blend_cfg)
    engine = create_engine(cfg)
    examples = load_musique(args.data or DEFAULT_MUSIQUE, limit=args.examples)
    runs = [ModeRun("full", "full", 1.0)]
    runs += [ModeRun(m, m, 1.0 if m == "prefix" else 0.0) for m in ("prefix", "reuse") if m in modes]
    runs += [ModeRun(f"blend@{r:g}", "blend", r) for r in (ratios if "blend" in modes else [])]
    rng = random.Random(args.seed)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    progress = _progress(len(examples))
    prompt_lens = []
    for ex in examples:
        engine.store = MemoryStore()  # bounded memory: each example starts with an empty store
        question = f"Question: {ex.question}\n{_answer_hint()}"
        cached_order = engine.segments(ex.passages, question, instruction=DEFAULT_INSTRUCTION + "\n\n")
        shuffled = list(ex.passages)
        rng.shuffle(shuffled)
        segs = engine.segments(shuffled, question, instruction=DEFAULT_INSTRUCTION + "\n\n")
        prompt_lens.append(segs.num_tokens)
        engine.precompute(segs.chunk_ids)  # untimed: chunk KV is computed once, offline
        if "prefix" in modes:  # warm the prefix cache with the passages in their original order
            engine.run(GenerationRequest(cached_order, SamplingParams(max_tokens=1), mode="prefix"))
        full_result = None
        for mr in runs:
            res = engine.run(GenerationRequest(segs, sampling, mode=mr.mode, recompute_ratio=mr.ratio))
            if mr.mode == "full":
                full_result = res
            answer = clean_answer(res.text)
            mr.ttft_ms.append(res.stats.ttft_ms)
            mr.answers.append(answer)
            mr.f1.append(max_over_golds(f1_score, answer, ex.answers))
            mr.first_token_agree.append(float(int(res.first_token_logits.argmax()) == int(full_result.first_token_logits.argmax())))
            mr.kl_vs_full.append(first_token_kl(full_result.first_token_logits, res.first_token_logits))
            mr.rouge_vs_full.append(rouge_l(res.text, full_result.text))
        progress.advance()
    progress.close()
    rows = [mr.summary(runs[0]) for mr in runs]
    result = {
        "bench": "engine", "model": engine.model_id, "model_dir": str(engine.loaded.model_dir),
        "dtype": cfg.model.dtype, "attention_kernel": engine.attention_kernel, "examples": len(examples), "check_layers": list(blend_cfg.check_layers),
        "check_ratios": list(blend_cfg.check_ratios), "deviation": args.deviation, "max_tokens": args.max_tokens,
        "threads": _threads(), "prompt_tokens_median": statistics.median(prompt_lens), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "modes": rows,
    }
    out = Path(args.out or f"bench/results/engine-{_slug(engine.model_id)}-{cfg.model.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(render_table(result))
    print(f"\nwrote {out}")
    return 0


def first_token_kl(reference_logits, logits) -> float:
    """KL(reference || other) of the two first-token distributions, in nats: finer than agreement, which
    only sees the argmax (on short-answer prompts mostly "The")."""
    ref = reference_logits.float().log_softmax(-1)
    other = logits.float().log_softmax(-1)
    return float((ref.exp() * (ref - other)).sum())


def _answer_hint() -> str:
    from kvblend.bench.data import ANSWER_SUFFIX

    return ANSWER_SUFFIX


def render_table(result: dict) -> str:
    lines = [f"### bench engine: {result['model']} ({result['dtype']}, {result.get('attention_kernel', 'torch')} "
             f"attention), {result['examples']} MuSiQue examples, check layers {result['check_layers']}",
             "", "| mode | median TTFT (ms) | speedup vs full | paired speedup | F1 | first-token agreement | "
             "first-token KL vs full | Rouge-L vs full |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["modes"]:
        paired = r.get("speedup_paired_median")
        lines.append(f"| {r['name']} | {r['ttft_median_ms']:.1f} | {r['speedup_vs_full']:.2f}x | "
                     f"{f'{paired:.2f}x' if paired else '-'} | {r['f1']:.3f} | "
                     f"{r['first_token_agreement']:.0%} | {_num(r.get('first_token_kl_vs_full'))} | "
                     f"{r['rouge_l_vs_full']:.3f} |")
    return "\n".join(lines)


def _num(x, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


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
