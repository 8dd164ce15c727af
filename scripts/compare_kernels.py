"""Full prefill and blend@R of one MuSiQue prompt on several (dtype, attention kernel[, deviation])
engines, interleaved round by round, so a busy host slows every engine alike. Answers "which dtype
and kernel should this CPU run?" (and "what does a check cost?") with ratios measured in one run.

    .venv/bin/python scripts/compare_kernels.py
        [--engines float32/avx2,bfloat16/torch,bfloat16/avx512bf16]
        [--model x.gguf] [--example 0] [--rounds 4] [--warmup 1] [--ratio 0.15] [--max-tokens 1]
        [--threads 2] [--out bench/results/kernels-....json]

An engine is dtype/kernel or dtype/kernel/deviation (``bfloat16/auto/v,bfloat16/auto/attn``:
blend's check by V deviation at layer 1 against attention-output deviation at layer 0;
default: BlendConfig's).

The first ``--warmup`` rounds (default 1) warm every engine (kernels built, buffers pooled) and are
not counted. Each engine prints its median TTFT per mode and the first token (the engines should
agree on it); with ``--max-tokens`` > 1 also the median decoding ms a token (the request's time
after the first token, over the tokens after it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvblend.bench.data import DEFAULT_MUSIQUE, load_musique  # noqa: E402
from kvblend.bench.engine_bench import bench_segments  # noqa: E402
from kvblend.config import BlendConfig, EngineConfig, ModelConfig  # noqa: E402
from kvblend.engine.engine import create_engine  # noqa: E402
from kvblend.engine.request import GenerationRequest, SamplingParams  # noqa: E402
from kvblend.platform import cpu_model_name  # noqa: E402


def create_engines(names: list[str], threads: int, model: str = "") -> dict:
    engines = {}
    for name in names:
        dtype, _, rest = name.partition("/")
        kernel, _, deviation = rest.partition("/")
        cfg = ModelConfig(
            model=model, dtype=dtype, num_threads=threads, attention_kernel=kernel or "auto"
        )
        # every request recomputes: no chained blended-prefix entries, so rounds
        # measure the same work
        blend = BlendConfig(
            store_blended_prefix=False, **({"deviation": deviation} if deviation else {})
        )
        engines[name] = create_engine(EngineConfig(model=cfg, blend=blend))
    return engines


def run_rounds(
    engines: dict,
    segs: dict,
    modes: list[tuple[str, float | None]],
    rounds: int,
    warmup: int = 1,
    max_tokens: int = 1,
) -> dict:
    ttft = {(name, mode): [] for name in engines for mode, _ in modes}
    decode = {(name, mode): [] for name in engines for mode, _ in modes}
    first = {}
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for rnd in range(rounds + warmup):
        for name, engine in engines.items():
            for mode, ratio in modes:
                t0 = time.perf_counter()
                res = engine.run(
                    GenerationRequest(segs[name], sampling, mode=mode, recompute_ratio=ratio)
                )
                wall_ms = (time.perf_counter() - t0) * 1e3
                if rnd >= warmup:
                    ttft[(name, mode)].append(res.stats.ttft_ms)
                    if len(res.token_ids) > 1:  # every token after the first is one decoding step
                        decode[(name, mode)].append(
                            (wall_ms - res.stats.ttft_ms) / (len(res.token_ids) - 1)
                        )
                first[(name, mode)] = int(res.first_token_logits.argmax())
                print(
                    f"  round {rnd}{' (warm-up)' if rnd < warmup else ''} {name} {mode}: TTFT "
                    f"{res.stats.ttft_ms:.0f} ms, {len(res.token_ids)} tokens in {wall_ms:.0f} ms",
                    flush=True,
                )
    out = {}
    for name in engines:
        out[name] = {}
        for mode, _ in modes:
            d = decode[(name, mode)]
            out[name][mode] = {
                "median_ttft_ms": statistics.median(ttft[(name, mode)]),
                "ttft_ms": ttft[(name, mode)],
                "first_token": first[(name, mode)],
                "median_decode_ms_per_token": statistics.median(d) if d else None,
                "decode_ms_per_token": [round(x, 2) for x in d],
            }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument(
        "--engines",
        default="float32/avx2,bfloat16/torch,bfloat16/avx512bf16",
        help="comma-separated dtype/kernel[/deviation] (kernel: auto, amx, avx512bf16, avx2, "
        "torch; deviation: v, k, kv, attn)",
    )
    p.add_argument("--example", type=int, default=0, help="MuSiQue example index")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    p.add_argument(
        "--model", default="", help="HF dir or .gguf (default: the embedded SmolLM2-135M)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=1, help="tokens a request (> 1 also times decoding)"
    )
    p.add_argument("--ratio", type=float, default=0.15, help="blend's recompute ratio")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engines = create_engines(args.engines.split(","), args.threads, args.model)
    ex = load_musique(DEFAULT_MUSIQUE, limit=args.example + 1)[args.example]
    segs = {}
    for name, engine in engines.items():
        segs[name] = bench_segments(engine, list(reversed(ex.passages)), ex.question)
        engine.precompute(segs[name].chunk_ids)
    blend = f"blend@{args.ratio:g}"
    results = run_rounds(
        engines,
        segs,
        [("full", None), ("blend", args.ratio)],
        args.rounds,
        args.warmup,
        args.max_tokens,
    )
    for name, res in results.items():
        res[blend] = res.pop("blend")
        full, part = res["full"]["median_ttft_ms"], res[blend]["median_ttft_ms"]
        res["speedup"] = full / part
        dec = res["full"]["median_decode_ms_per_token"]
        print(
            f"{name} ({engines[name].attention_kernel}): full {full:.0f} ms, {blend} {part:.0f} ms "
            f"({full / part:.2f}x); first tokens {res['full']['first_token']} / "
            f"{res[blend]['first_token']}"
            + (f"; decoding {dec:.0f} ms a token (after full)" if dec is not None else "")
        )
    if args.out:
        out = {
            "cpu": cpu_model_name(),
            "threads": args.threads,
            "example": args.example,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "model": args.model or "embedded",
            "max_tokens": args.max_tokens,
            "attention_kernels": {name: e.attention_kernel for name, e in engines.items()},
            "prompt_tokens": next(iter(segs.values())).num_tokens,
            "engines": results,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
