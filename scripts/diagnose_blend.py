"""What does the stale chunk KV get wrong, and which recompute schemes repair it? (issue 28)

    nice .venv/bin/python scripts/diagnose_blend.py --model GGUF --examples 6 \
        --out bench/results/diagnose-<model>.json

Per prompt (built as `kvblend bench engine` builds it, same shuffle), against full prefill:
  layer_error      per layer, relative L2 error of the stored (chunk computed alone) K and V of
                   chunk rows, split into chunk-initial rows (the first ``--starts`` of each chunk)
                   and the rest
  query_reads      per layer, the share of the query's attention on the prefix (the sink), on
                   chunk-initial rows, on the other chunk rows and on the query itself, over full
                   prefill's KV and over the stored KV (a reuse pass: what lookahead sees)
  recall           how many of full prefill's top-r chunk rows (by the query's attention summed over
                   layers) the reuse pass's ranking finds: the ceiling of lookahead's estimate
  variants         first-token agreement and KL of recompute schemes at each ratio
                   (selection_oracle's, plus the ones below)
Extra schemes (references for the engine's options):
  lookahead+tempS  lookahead, with the stored chunk K that stays reused scaled by S (an attention
                   temperature on reused chunks, as APE does; K is linear under RoPE, so it scales
                   logits)
  wide             lookahead's ranking picks 2x the budget from layer 0; a query check at the middle
                   layer keeps the budget from there on (per-layer budgets: cost ~1.5x the ratio)
  tailN            lookahead's rows recomputed up to the last N layers only, which reuse every
                   chunk row's stored KV (cost ~(L-N)/L of the ratio's)
  ctxprefix        chunks precomputed behind the whole prompt prefix (template + instruction)
                   instead of the template's opening only; reuse and lookahead
Timing is not measured here (see `kvblend bench engine`); this is the fidelity side only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import selection_oracle as oracle  # noqa: E402

from kvblend.bench.data import load_examples  # noqa: E402
from kvblend.bench.engine_bench import bench_segments, first_token_kl  # noqa: E402
from kvblend.blend import blender  # noqa: E402
from kvblend.blend.selection import num_to_keep, select_top_tokens  # noqa: E402
from kvblend.blend.strategies import QuerySelection  # noqa: E402
from kvblend.config import EngineConfig, ModelConfig  # noqa: E402
from kvblend.engine.engine import create_engine  # noqa: E402
from kvblend.store.memory import MemoryStore  # noqa: E402

BASE_VARIANTS = ("deviation", "lookahead", "oracle-attn", "oracle-dev", "random")


class LayerRecorder:
    """Per-layer snapshots of the query attention a recording pass adds (PyTorch attention path
    only: the native kernels add key mass in place, without a per-layer call)."""

    def __init__(self):
        self.layers: list[torch.Tensor] = []
        self._orig = blender.QueryAttentionRecorder.add

    def __enter__(self):
        orig, layers = self._orig, self.layers

        def add(rec, q, keys, active):
            before = rec.total.clone()
            orig(rec, q, keys, active)
            layers.append(rec.total - before)  # [T]

        blender.QueryAttentionRecorder.add = add
        return self

    def __exit__(self, *exc):
        blender.QueryAttentionRecorder.add = self._orig


def chunk_starts_mask(p: oracle.Prompt, count: int) -> torch.Tensor:
    mask = torch.zeros(p.num_tokens, dtype=torch.bool)
    for start, end in p.chunk_spans:
        mask[start : min(end, start + count)] = True
    return mask


def layer_error(p: oracle.Prompt, starts: torch.Tensor) -> dict:
    """Per layer: ||stored - full|| / ||full|| over chunk rows, K (pre-RoPE) and
    V, starts vs rest."""
    out = {}
    chunk = torch.zeros(p.num_tokens, dtype=torch.bool)
    chunk[p.chunk_rows] = True
    for name, rows in (("starts", chunk & starts), ("rest", chunk & ~starts)):
        for kind, full, stored in (("k", p.full_k, p.stored_k), ("v", p.full_v, p.stored_v)):
            f, s = full[:, :, rows].float(), stored[:, :, rows].float()  # [L, Hkv, R, d]
            err = (s - f).pow(2).sum(dim=(1, 2, 3)).sqrt() / f.pow(2).sum(
                dim=(1, 2, 3)
            ).sqrt().clamp_min(1e-9)
            out[f"{kind}_{name}"] = [round(x, 4) for x in err.tolist()]
    return out


def query_reads(p: oracle.Prompt, exact: bool, starts: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Per layer shares of the query's attention, and the [chunk rows] total over layers."""
    with LayerRecorder() as rec:
        total = p.query_attention(exact=exact)
    groups = {
        "prefix": torch.zeros(p.num_tokens, dtype=torch.bool),
        "query": torch.zeros_like(starts),
    }
    groups["prefix"][: p.prefix_len] = True
    groups["query"][p.query_rows] = True
    chunk = ~(groups["prefix"] | groups["query"])
    groups["chunk_starts"], groups["chunk_rest"] = chunk & starts, chunk & ~starts
    shares = {name: [] for name in groups}
    for per_layer in rec.layers:
        mass = per_layer.float().sum().clamp_min(1e-9)
        for name, mask in groups.items():
            shares[name].append(round(float(per_layer[mask].sum() / mass), 4))
    return shares, total


def recall(reference: torch.Tensor, estimate: torch.Tensor, num_keep: int) -> float:
    top_ref = set(select_top_tokens(reference, num_keep).tolist())
    top_est = set(select_top_tokens(estimate, num_keep).tolist())
    return len(top_ref & top_est) / max(1, num_keep)


def scaled_stored_k(p: oracle.Prompt, scale: float) -> torch.Tensor:
    k = p.stored_k.clone()
    k[:, :, p.chunk_rows] = (k[:, :, p.chunk_rows].float() * scale).to(k.dtype)
    return k


def extra_logits(
    p: oracle.Prompt, variant: str, num_keep: int, reuse_attn: torch.Tensor
) -> torch.Tensor:
    rows = p.chunk_rows
    chosen = rows[select_top_tokens(reuse_attn, num_keep)]
    if variant.startswith("lookahead+temp"):
        scale = float(variant.removeprefix("lookahead+temp"))
        active = torch.unique(torch.cat([p.query_rows, chosen]))
        return p.run(
            scaled_stored_k(p, scale), p.stored_v.clone(), p.stored_mask, active
        ).last_logits
    if variant == "wide":
        wide = rows[select_top_tokens(reuse_attn, min(rows.numel(), 2 * num_keep))]
        middle = p.ops.num_layers // 2
        return p.blend(
            wide, check_layers=(middle,), check_keep=(num_keep,), selection=QuerySelection()
        )
    if variant.startswith("tail"):  # the last N layers reuse every chunk row's stored KV
        first_stale = p.ops.num_layers - int(variant.removeprefix("tail"))
        return p.blend(
            chosen, check_layers=(first_stale,), check_keep=(0,), selection=QuerySelection()
        )
    raise ValueError(variant)


def run_variants(
    p, ratios, variants, extras, gen, reuse_attn, full_attn, screen_only=(), screen_ratio=0.15
) -> dict:
    """Each variant at each ratio, except ``screen_only`` ones (and the extras): at
    ``screen_ratio`` only."""
    out = {}
    for r in ratios:
        num_keep = num_to_keep(r, p.chunk_rows.numel())
        out[f"recall@{r:g}"] = round(recall(full_attn, reuse_attn, num_keep), 4)
        for v in variants:
            if v in screen_only and r != screen_ratio:
                continue
            t0 = time.perf_counter()
            logits = oracle.variant_logits(p, v, num_keep, gen)
            out[f"{v}@{r:g}"] = score(p, logits, time.perf_counter() - t0)
        for v in extras if r == screen_ratio else ():
            t0 = time.perf_counter()
            out[f"{v}@{r:g}"] = score(
                p, extra_logits(p, v, num_keep, reuse_attn), time.perf_counter() - t0
            )
    reuse = p.run(p.stored_k.clone(), p.stored_v.clone(), p.stored_mask, p.query_rows).last_logits
    out["reuse"] = score(p, reuse, 0.0)
    return out


def score(p: oracle.Prompt, logits: torch.Tensor, seconds: float) -> dict:
    return {
        "agree": float(int(logits.argmax()) == int(p.full_logits.argmax())),
        "kl": round(first_token_kl(p.full_logits, logits), 5),
        "s": round(seconds, 2),
    }


def context_variant(engine, segs, p: oracle.Prompt, ratio: float) -> dict:
    """Chunks precomputed behind the whole prompt prefix: reuse and lookahead@ratio."""
    saved = engine.chunk_context_ids
    engine.chunk_context_ids = list(segs.prefix_ids)
    try:
        engine.store = MemoryStore()
        engine.precompute(segs.chunk_ids)
        k, v = p.stored_k.clone(), p.stored_v.clone()
        for (start, end), ids in zip(p.chunk_spans, segs.chunk_ids):
            kv = engine.store.get(engine.chunk_key(ids))
            k[:, :, start:end], v[:, :, start:end] = kv.k, kv.v
    finally:
        engine.chunk_context_ids = saved
    out = {
        "ctxprefix-reuse": score(
            p, p.run(k.clone(), v.clone(), p.stored_mask, p.query_rows).last_logits, 0
        )
    }
    attn = p.run(
        k.clone(), v.clone(), p.stored_mask, p.query_rows, record_query_attention=True
    ).query_attention
    num_keep = num_to_keep(ratio, p.chunk_rows.numel())
    chosen = p.chunk_rows[select_top_tokens(attn[p.chunk_rows], num_keep)]
    active = torch.unique(torch.cat([p.query_rows, chosen]))
    out[f"ctxprefix-lookahead@{ratio:g}"] = score(
        p, p.run(k, v, p.stored_mask, active).last_logits, 0
    )
    return out


def summarize(per_example: list[dict]) -> dict:
    keys = [k for k in per_example[0]["variants"] if not k.startswith("recall")]
    table = {}
    for k in keys:
        rows = [ex["variants"][k] for ex in per_example if k in ex["variants"]]
        table[k] = {
            "agreement": round(statistics.fmean(r["agree"] for r in rows), 3),
            "kl_mean": round(statistics.fmean(r["kl"] for r in rows), 4),
            "kl_median": round(statistics.median(r["kl"] for r in rows), 4),
            "n": len(rows),
        }
    for k in [k for k in per_example[0]["variants"] if k.startswith("recall")]:
        table[k] = round(statistics.fmean(ex["variants"][k] for ex in per_example), 3)
    return table


def mean_curves(per_example: list[dict], field: str) -> dict:
    names = per_example[0][field].keys()
    return {
        n: [round(statistics.fmean(vals), 4) for vals in zip(*(ex[field][n] for ex in per_example))]
        for n in names
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--data", default="musique")
    ap.add_argument("--examples", type=int, default=6)
    ap.add_argument("--ratios", default="0.1,0.15,0.3")
    ap.add_argument("--variants", default=",".join(BASE_VARIANTS) + ",starts4+lookahead")
    ap.add_argument("--extras", default="lookahead+temp0.9,lookahead+temp1.1,wide")
    ap.add_argument(
        "--screen-only",
        default="deviation,oracle-dev,starts4+lookahead",
        help="variants run at --screen-ratio only (the rest at every ratio)",
    )
    ap.add_argument("--screen-ratio", type=float, default=0.15)
    ap.add_argument(
        "--context-variant", action="store_true", help="also chunks behind the whole prefix"
    )
    ap.add_argument("--starts", type=int, default=4, help="chunk-initial rows per chunk")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    extras = [v for v in args.extras.split(",") if v]
    # PyTorch attention: the recorder then sees every layer (the native kernels
    # add key mass in place)
    engine = create_engine(
        EngineConfig(
            model=ModelConfig(model=args.model, dtype=args.dtype, attention_kernel="torch")
        )
    )
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    per_example = []
    with torch.inference_mode():
        for index, ex in enumerate(load_examples(args.data, limit=args.examples)):
            shuffled = list(ex.passages)
            rng.shuffle(shuffled)
            engine.store = MemoryStore()
            segs = bench_segments(engine, shuffled, ex.question)
            p = oracle.Prompt(engine, segs)
            starts = chunk_starts_mask(p, args.starts)
            reads_full, full_attn = query_reads(p, True, starts)
            reads_reuse, reuse_attn = query_reads(p, False, starts)
            row = {
                "tokens": p.num_tokens,
                "layer_error": layer_error(p, starts),
                "query_reads_full": reads_full,
                "query_reads_reuse": reads_reuse,
                "variants": run_variants(
                    p,
                    ratios,
                    variants,
                    extras,
                    gen,
                    reuse_attn,
                    full_attn,
                    set(args.screen_only.split(",")),
                    args.screen_ratio,
                ),
            }
            if args.context_variant:
                row["variants"].update(context_variant(engine, segs, p, 0.15))
            per_example.append(row)
            print(
                f"example {index} ({p.num_tokens} tokens): "
                + ", ".join(
                    f"{k} {v['agree']:.0f}/{v['kl']:.3f}"
                    for k, v in row["variants"].items()
                    if isinstance(v, dict)
                ),
                flush=True,
            )
            write(args, engine, per_example)
    for k, v in summarize(per_example).items():
        print(k, v)
    return 0


def write(args, engine, per_example: list[dict]) -> None:
    result = {
        "script": "diagnose_blend",
        "model": engine.model_id,
        "dtype": args.dtype,
        "data": args.data,
        "examples": len(per_example),
        "starts": args.starts,
        "summary": summarize(per_example),
        "layer_error_mean": {
            k: [
                round(statistics.fmean(x), 4)
                for x in zip(*(ex["layer_error"][k] for ex in per_example))
            ]
            for k in per_example[0]["layer_error"]
        },
        "query_reads_full_mean": mean_curves(per_example, "query_reads_full"),
        "query_reads_reuse_mean": mean_curves(per_example, "query_reads_reuse"),
        "per_example": per_example,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
