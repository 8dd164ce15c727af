"""A decoding step's time with the native few-row projections (kvblend/kernels/gemv.h) against
PyTorch's bf16 matmul, in one process over one cache, interleaved round by round (paired), so a busy
host slows both alike.

    .venv/bin/python scripts/decode_bench.py [--model DIR|GGUF] [--passages 2] [--rounds 12]
        [--steps 3] [--out bench/results/decode-<model>.json]

One MuSiQue prompt (its first ``--passages`` passages and question) is prefilled in full; then each
round runs ``--steps`` decoding steps of the same sequence per variant (after one untimed step):
``native`` (the engine as it ships) and ``torch`` (every projection through F.linear). Writes each
round's ms a step and the medians, with the paired ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvblend.platform import apply_malloc_defaults, apply_openmp_defaults  # noqa: E402

apply_openmp_defaults()  # the CLI's process settings, before torch loads OpenMP
apply_malloc_defaults()

import torch  # noqa: E402

from kvblend.bench.data import DEFAULT_MUSIQUE, load_musique  # noqa: E402
from kvblend.bench.engine_bench import bench_segments  # noqa: E402
from kvblend.client.stream import parse_mode_spec  # noqa: E402
from kvblend.config import BlendConfig, EngineConfig, ModelConfig  # noqa: E402
from kvblend.engine.engine import create_engine  # noqa: E402
from kvblend.engine.request import GenerationRequest, SamplingParams  # noqa: E402
from kvblend.models.transformer import TransformerOps  # noqa: E402
from kvblend.platform import cpu_model_name  # noqa: E402


def time_steps(engine, seq, num_steps: int) -> float:
    engine.step([seq])  # untimed: the other variant's last weights leave the cache
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step([seq])
    return (time.perf_counter() - start) / num_steps * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--model", default="", help="HF dir or .gguf (default: the embedded model)")
    p.add_argument("--passages", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    cfg = ModelConfig(model=args.model, dtype="bfloat16", device="cpu")
    engine = create_engine(EngineConfig(model=cfg, blend=BlendConfig(store_blended_prefix=False)))
    example = load_musique(DEFAULT_MUSIQUE, limit=1)[0]
    segs = bench_segments(engine, example.passages[: args.passages], example.question)
    max_tokens = args.rounds * 2 * (args.steps + 1) + 2
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seq = engine.start(GenerationRequest(segs, sampling, parse_mode_spec("full")))
    native = TransformerOps._gemv_takes
    rounds: dict[str, list[float]] = {"native": [], "torch": []}
    for _ in range(args.rounds):
        for name in rounds:
            TransformerOps._gemv_takes = native if name == "native" else (lambda *a: False)
            rounds[name].append(round(time_steps(engine, seq, args.steps), 2))
    TransformerOps._gemv_takes = native
    medians = {name: statistics.median(ms) for name, ms in rounds.items()}
    ratio = statistics.median(t / n for t, n in zip(rounds["torch"], rounds["native"]))
    result = {
        "bench": "decode_projections",
        "model": engine.model_id,
        "dtype": "bfloat16",
        "attention_kernel": engine.attention_kernel,
        "cpu": cpu_model_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "prompt_tokens": segs.num_tokens,
        "steps_per_round": args.steps,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rounds_ms": rounds,
        "median_ms": medians,
        "paired_speedup": round(ratio, 3),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rounds_ms"}))
    out = args.out or Path("bench/results") / f"decode-{engine.model_id}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
