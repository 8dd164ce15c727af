"""Where a prefill's time goes: median TTFT per mode, then one torch.profiler table
per mode (CPU or CUDA).

    .venv/bin/python scripts/profile_prefill.py [--model DIR|GGUF] [--device cuda]
        [--dtype bfloat16] [--modes full,reuse,blend@0.15,blend@0.15/lookahead] [--example 0]
        [--repeats 5] [--rows 15] [--variants gqa,expand] [--shapes] [--parts] [--decode-tokens 32]

--parts times the parts of each mode's requests by wrapping the engine's calls (means over --repeats
requests, so the parts add up to the mean TTFT): loading stored KV (what the request waited for),
norms + Q/K/V projections, the attention calls (the native kernel's key preparation included),
o_proj + MLP, row scatters, the last row's logits, and the rest (planning, selection, Python). The
native kernels run outside torch.profiler, which sees only PyTorch's ops.

--random-weights DIR builds a random-weight model from DIR's config.json and tokenizer files (timing
does not depend on the weights, so a machine without the real weights can still be profiled).
--variants compares ways of calling PyTorch's attention in one run: "gqa" (the engine's: K/V heads
shared through enable_gqa) and "expand" (K/V repeated to every query head first, which some SDPA
backends need to pick a fused kernel). Every request recomputes (no chained blended-prefix entries),
so repeats measure the same work.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvblend.platform import apply_malloc_defaults, apply_openmp_defaults  # noqa: E402

# the `kvblend` CLI's process settings, so that timings here are the bench's:
# before torch loads OpenMP
apply_openmp_defaults()
apply_malloc_defaults()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvblend.bench.data import DEFAULT_MUSIQUE, load_musique  # noqa: E402
from kvblend.bench.engine_bench import bench_segments  # noqa: E402
from kvblend.blend.blender import KernelAttention, TorchAttention  # noqa: E402
from kvblend.client.stream import parse_mode_spec  # noqa: E402
from kvblend.config import BlendConfig, EngineConfig, ModelConfig  # noqa: E402
from kvblend.engine.engine import create_engine  # noqa: E402
from kvblend.engine.request import GenerationRequest, SamplingParams  # noqa: E402
from kvblend.models.transformer import TransformerOps  # noqa: E402
from kvblend.policy import PrefillPolicy  # noqa: E402


def random_weights_dir(config_dir: Path, dtype: torch.dtype) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(tempfile.mkdtemp(prefix="kvblend-random-"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir)).to(
        dtype
    ).save_pretrained(out)
    for f in config_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def expanded_attend(self, q, k, v, mask, causal=True):
    """TransformerOps.attend with K/V repeated to every query head (no enable_gqa)."""
    rep = self.num_heads // self.num_kv_heads
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    kwargs = {"is_causal": causal} if mask is None else {"attn_mask": mask}
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=self.scaling, **kwargs)
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)


def mode_request(
    segs, spec: PrefillPolicy, sampling: SamplingParams | None = None
) -> GenerationRequest:
    """``spec`` as `eval` names modes (blend@0.15/lookahead); a bare blend takes the engine's ratio.
    One token unless ``sampling`` says otherwise."""
    return GenerationRequest(segs, sampling or SamplingParams(max_tokens=1), spec)


def decode_ms_per_token(engine, segs, spec: PrefillPolicy, num_tokens: int, repeats: int) -> float:
    """Median time a decoded token takes after ``spec``'s prefill (the first token excluded)."""
    sampling = SamplingParams(max_tokens=num_tokens + 1, ignore_eos=True)
    per_token = []
    for i in range(repeats + 1):  # the first run warms up
        start = time.perf_counter()
        stats = engine.run(mode_request(segs, spec, sampling)).stats
        if i:
            per_token.append(((time.perf_counter() - start) * 1e3 - stats.ttft_ms) / num_tokens)
    return statistics.median(per_token)


def time_mode(engine, segs, spec: PrefillPolicy, repeats: int) -> list[float]:
    for _ in range(2):  # warm-up: kernels chosen, buffers pooled
        engine.run(mode_request(segs, spec))
    return [engine.run(mode_request(segs, spec)).stats.ttft_ms for _ in range(repeats)]


# (label, object, method) of the calls --parts times; "attention" is the blender's attention call
PARTS = (
    ("q/k/v", TransformerOps, "qkv"),
    ("attention", KernelAttention, "__call__"),
    ("attention", TorchAttention, "__call__"),
    ("o_proj + MLP", TransformerOps, "finish_layer"),
    ("row scatter", TransformerOps, "write_rows"),
    ("logits", TransformerOps, "logits"),
)


@contextlib.contextmanager
def timed_parts(device: str):
    """Seconds spent in each PARTS label while inside, summed over calls (nested
    calls count once)."""
    totals: dict[str, float] = collections.defaultdict(float)
    depth = [0]
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def wrap(label, fn):
        def timed(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                totals[label] += time.perf_counter() - start
                depth[0] -= 1

        return timed

    originals = [(owner, name, getattr(owner, name)) for _, owner, name in PARTS]
    for (label, owner, name), (_, _, fn) in zip(PARTS, originals):
        setattr(owner, name, wrap(label, fn))
    try:
        yield totals
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def parts_table(engine, segs, spec: PrefillPolicy, device: str, repeats: int) -> str:
    """Markdown rows: where ``spec``'s requests spend their time, in ms a request (means
    over ``repeats``)."""
    time_mode(engine, segs, spec, 0)  # warm-up
    with timed_parts(device) as totals:
        stats = [engine.run(mode_request(segs, spec)).stats for _ in range(repeats)]
    ttft = statistics.mean(s.ttft_ms for s in stats)
    parts = {"stored KV load (waited)": statistics.mean(s.load_ms for s in stats)}
    parts.update({label: seconds * 1e3 / repeats for label, seconds in totals.items()})
    parts["rest (planning, selection, Python)"] = ttft - sum(parts.values())
    lines = [
        f"\n{spec.label}: mean TTFT {ttft:.1f} ms (median "
        f"{statistics.median(s.ttft_ms for s in stats):.1f})",
        "| part | ms a request | share |",
        "|---|---:|---:|",
    ]
    lines += [f"| {label} | {ms:.1f} | {ms / ttft:.0%} |" for label, ms in parts.items()]
    return "\n".join(lines)


def profile_mode(
    engine, segs, spec: PrefillPolicy, device: str, rows: int, shapes: bool = False
) -> str:
    """One request under torch.profiler; ``shapes``: one table row per op and input shapes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with profile(activities=activities, record_shapes=shapes) as prof:
        engine.run(mode_request(segs, spec))
    key = "self_cuda_time_total" if device != "cpu" else "self_cpu_time_total"
    return prof.key_averages(group_by_input_shape=shapes).table(sort_by=key, row_limit=rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--model", default="", help="HF dir or .gguf (default: the embedded model)")
    p.add_argument(
        "--random-weights",
        default=None,
        metavar="DIR",
        help="config + tokenizer dir; random weights",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--modes", default="full,reuse,blend@0.15")
    p.add_argument("--example", type=int, default=0, help="MuSiQue example index")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", type=int, default=15, help="profiler table rows (0: no table)")
    p.add_argument("--variants", default="gqa", help="comma-separated: gqa, expand")
    p.add_argument("--shapes", action="store_true", help="profiler rows per op and input shapes")
    p.add_argument(
        "--parts",
        action="store_true",
        help="a table per mode of the time in each part of a request",
    )
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=0,
        metavar="N",
        help="also decode N tokens after each mode's first (EOS ignored): median ms a token",
    )
    args = p.parse_args()
    cfg = ModelConfig(
        model=args.model, dtype=args.dtype, device=args.device, num_threads=args.threads
    )
    if args.random_weights:
        cfg.model = str(random_weights_dir(Path(args.random_weights), getattr(torch, cfg.dtype)))
    engine = create_engine(EngineConfig(model=cfg, blend=BlendConfig(store_blended_prefix=False)))
    ex = load_musique(DEFAULT_MUSIQUE, limit=args.example + 1)[args.example]
    segs = bench_segments(engine, list(reversed(ex.passages)), ex.question)
    engine.precompute(segs.chunk_ids)
    print(
        f"{engine.model_id} {cfg.dtype} on {args.device} "
        f"({torch.cuda.get_device_name() if args.device != 'cpu' else 'cpu'}), attention "
        f"kernel {engine.attention_kernel}, {segs.num_tokens} prompt tokens, "
        f"{torch.get_num_threads()} threads"
    )
    specs = [parse_mode_spec(text) for text in args.modes.split(",")]
    original = TransformerOps.attend
    for variant in args.variants.split(","):
        TransformerOps.attend = expanded_attend if variant == "expand" else original
        for spec in specs:
            ttft = time_mode(engine, segs, spec, args.repeats)
            print(
                f"[{variant}] {spec.label}: median TTFT {statistics.median(ttft):.1f} ms (min "
                f"{min(ttft):.1f}, n={len(ttft)})",
                flush=True,
            )
            if args.decode_tokens > 0:
                ms = decode_ms_per_token(engine, segs, spec, args.decode_tokens, args.repeats)
                print(
                    f"[{variant}] {spec.label}: decoding {ms:.2f} ms a token "
                    f"({args.decode_tokens} tokens)",
                    flush=True,
                )
        if args.parts:
            for spec in specs:
                print(parts_table(engine, segs, spec, args.device, args.repeats), flush=True)
        if args.rows:
            for spec in specs:
                table = profile_mode(engine, segs, spec, args.device, args.rows, args.shapes)
                print(f"\n--- [{variant}] {spec.label} ---\n{table}", flush=True)
    TransformerOps.attend = original
    return 0


if __name__ == "__main__":
    sys.exit(main())
