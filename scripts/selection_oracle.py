"""How good could token selection get? First-token agreement and KL against full prefill when the
recomputed chunk rows are chosen by the engine's selections and by two oracles that
peek at full prefill.

    .venv/bin/python scripts/selection_oracle.py [--model GGUF|DIR] [--examples 10]
        [--ratios 0.15,0.3]

Every variant recomputes the same number of chunk rows (``num_to_keep(ratio, chunk rows)``) plus the
query; the prefix is exact. Variants:
  deviation      the engine's default: V deviation at check layer 1 (rows narrowed there)
  attn           the engine's --deviation attn: layer-0 attention output over every key vs over the
                 prefix and the row's own chunk (rows narrowed after layer 0's attention)
  lookahead      the engine's: query attention summed over a reuse pass, rows recomputed
                 from layer 0
  lookahead:N    the same over the reuse pass's first N layers only (BlendConfig.lookahead_layers)
  random         uniform random chunk rows, recomputed from layer 0 (the floor)
  starts         the first rows of every chunk, as many from each (EPIC's static choice, arXiv
                 2410.15332), recomputed from layer 0
  startsN+lookahead[:M]  the first N rows of every chunk, the rest of the budget by lookahead's
                         ranking
  oracle-attn    query attention summed over the layers of *full* prefill (what lookahead estimates)
  oracle-dev     K+V deviation of the stored rows from full prefill's, summed over layers (each
                 layer scaled by its mean), recomputed from layer 0: the rows whose stored KV is
                 most wrong
The oracles need full prefill first, so they are references, not selections a server could run.
Prompts are built as `kvblend bench engine` builds them (same shuffle), float32 by default.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvblend.bench.data import DEFAULT_MUSIQUE, load_musique  # noqa: E402
from kvblend.bench.engine_bench import bench_segments, first_token_kl  # noqa: E402
from kvblend.blend.blender import KVCache, PrefillPlan, run_prefill  # noqa: E402
from kvblend.blend.selection import num_to_keep, select_top_tokens  # noqa: E402
from kvblend.blend.strategies import DeviationSelection  # noqa: E402
from kvblend.config import EngineConfig, ModelConfig  # noqa: E402
from kvblend.engine.engine import create_engine  # noqa: E402
from kvblend.policy import parse_selection  # noqa: E402
from kvblend.store.memory import MemoryStore  # noqa: E402

VARIANTS = ("deviation", "attn", "lookahead", "random", "starts", "oracle-attn", "oracle-dev")


class Prompt:
    """One prompt's full-prefill reference and its stored KV (prefix exact,
    chunks computed alone)."""

    def __init__(self, engine, segs):
        self.ops = engine.ops
        self.ids = torch.tensor(segs.token_ids, dtype=torch.long)
        T = self.num_tokens = segs.num_tokens
        self.query_rows = torch.arange(T - len(segs.query_ids), T)
        self.chunk_rows = torch.arange(len(segs.prefix_ids), T - len(segs.query_ids))
        full = self.run(None, None, torch.zeros(T, dtype=torch.bool), torch.arange(T))
        self.full_logits = full.last_logits.clone()
        self.full_k, self.full_v = (
            full.fresh_k.clone(),
            full.fresh_v.clone(),
        )  # [L, Hkv, T, d] pre-RoPE
        self.stored_k, self.stored_v = self.full_k.clone(), self.full_v.clone()
        row = self.prefix_len = len(segs.prefix_ids)
        engine.precompute(segs.chunk_ids)
        spans = []
        for chunk_ids in segs.chunk_ids:
            kv = engine.store.get(
                engine.chunk_key(chunk_ids)
            )  # computed alone behind the chunk context
            self.stored_k[:, :, row : row + len(chunk_ids)] = kv.k
            self.stored_v[:, :, row : row + len(chunk_ids)] = kv.v
            spans.append((row, row + len(chunk_ids)))
            row += len(chunk_ids)
        self.chunk_spans = tuple(spans)
        self.stored_mask = torch.ones(T, dtype=torch.bool)
        self.stored_mask[self.query_rows] = False

    def run(self, k, v, stored_mask, active, **plan_kwargs):
        cache = KVCache.allocate(self.ops, self.num_tokens)
        plan = PrefillPlan(self.ids, k, v, stored_mask, active, **plan_kwargs)
        return run_prefill(self.ops, plan, cache)

    def blend(self, chosen: torch.Tensor, **plan_kwargs) -> torch.Tensor:
        """Last-token logits with the query and ``chosen`` chunk rows computed
        over the stored KV."""
        active = torch.unique(torch.cat([self.query_rows, chosen]))
        return self.run(
            self.stored_k.clone(), self.stored_v.clone(), self.stored_mask, active, **plan_kwargs
        ).last_logits

    def query_attention(self, exact: bool, num_layers: int | None = None) -> torch.Tensor:
        """[chunk rows] attention the query gives each chunk row, summed over layers (the first
        ``num_layers`` if given): over full prefill's KV (exact) or over the stored KV (a reuse
        pass, as lookahead does)."""
        k, v = (self.full_k, self.full_v) if exact else (self.stored_k, self.stored_v)
        out = self.run(
            k.clone(),
            v.clone(),
            self.stored_mask,
            self.query_rows,
            record_query_attention=True,
            num_layers=num_layers,
        )
        return out.query_attention[self.chunk_rows]

    def deviation(self) -> torch.Tensor:
        """[chunk rows] K+V deviation of stored from full, each layer divided by
        its mean, summed."""
        rows = self.chunk_rows
        total = torch.zeros(rows.numel())
        for full, stored in ((self.full_k, self.stored_k), (self.full_v, self.stored_v)):
            dev = ((full[:, :, rows].float() - stored[:, :, rows].float()) ** 2).sum(
                dim=(1, 3)
            )  # [L, R]
            total += (dev / dev.mean(dim=1, keepdim=True).clamp_min(1e-12)).sum(0)
        return total


def _is_lookahead_depth(variant: str) -> bool:
    try:
        return variant.startswith("lookahead:") and parse_selection(variant)[1] is not None
    except ValueError:
        return False


def _is_starts_plus_lookahead(variant: str) -> bool:
    count, _, selection = variant.removeprefix("starts").partition("+")
    return (
        variant.startswith("starts")
        and count.isdigit()
        and (selection == "lookahead" or _is_lookahead_depth(selection))
    )


def _chunk_starts(p: Prompt, count: int) -> torch.Tensor:
    """The first ``count`` rows of every chunk (fewer where a chunk is shorter), in prompt order."""
    return torch.cat([torch.arange(start, min(end, start + count)) for start, end in p.chunk_spans])


def variant_logits(p: Prompt, variant: str, num_keep: int, rng: torch.Generator) -> torch.Tensor:
    rows = p.chunk_rows
    if variant == "deviation":
        return p.blend(
            rows, check_layers=(1,), check_keep=(num_keep,), selection=DeviationSelection("v")
        )  # every chunk row until the check
    if variant == "attn":
        return p.blend(
            rows,
            check_layers=(0,),
            check_keep=(num_keep,),
            selection=DeviationSelection("attn"),
            chunk_spans=p.chunk_spans,
            prefix_len=p.prefix_len,
        )
    if variant == "random":
        return p.blend(rows[torch.randperm(rows.numel(), generator=rng)[:num_keep]])
    if variant == "starts":
        per_chunk = -(-num_keep // len(p.chunk_spans))
        return p.blend(_chunk_starts(p, per_chunk)[:num_keep])
    if variant.startswith("starts"):  # startsN+lookahead[:M]
        count, selection = variant.removeprefix("starts").split("+")
        depth = min(parse_selection(selection)[1] or p.ops.num_layers, p.ops.num_layers)
        score = p.query_attention(exact=False, num_layers=depth).clone()
        score[torch.isin(rows, _chunk_starts(p, int(count)))] = float("inf")  # always kept
        return p.blend(rows[select_top_tokens(score, num_keep)])
    if variant.startswith("lookahead:"):
        depth = min(parse_selection(variant)[1] or p.ops.num_layers, p.ops.num_layers)
        return p.blend(
            rows[select_top_tokens(p.query_attention(exact=False, num_layers=depth), num_keep)]
        )
    score = {
        "lookahead": lambda: p.query_attention(exact=False),
        "oracle-attn": lambda: p.query_attention(exact=True),
        "oracle-dev": p.deviation,
    }[variant]()
    return p.blend(rows[select_top_tokens(score, num_keep)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF dir or .gguf (default: the embedded model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--examples", type=int, default=10)
    ap.add_argument("--ratios", default="0.15")
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, from {', '.join(VARIANTS)}, lookahead:N and startsN+lookahead[:M] "
        "(default: the fixed list)",
    )
    ap.add_argument("--out", default=None, help="JSON of per-example results")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = {
        v
        for v in variants
        if v not in VARIANTS and not _is_lookahead_depth(v) and not _is_starts_plus_lookahead(v)
    }
    if unknown:
        raise SystemExit(f"selection_oracle: unknown variant(s) {', '.join(sorted(unknown))}")
    ratios = [float(r) for r in args.ratios.split(",")]
    engine = create_engine(
        EngineConfig(
            model=ModelConfig(model=args.model, dtype=args.dtype, num_threads=args.threads)
        )
    )
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    results = {f"{v}@{r:g}": {"agree": [], "kl": []} for r in ratios for v in variants}
    with torch.inference_mode():
        for index, ex in enumerate(load_musique(DEFAULT_MUSIQUE, limit=args.examples)):
            shuffled = list(ex.passages)
            rng.shuffle(shuffled)  # the order `bench engine --seed 0` gives this example
            engine.store = MemoryStore()  # bounded memory: each example starts with an empty store
            segs = bench_segments(engine, shuffled, ex.question)
            p = Prompt(engine, segs)
            for r in ratios:
                num_keep = num_to_keep(r, p.chunk_rows.numel())
                for v in variants:
                    logits = variant_logits(p, v, num_keep, gen)
                    res = results[f"{v}@{r:g}"]
                    res["agree"].append(float(int(logits.argmax()) == int(p.full_logits.argmax())))
                    res["kl"].append(round(first_token_kl(p.full_logits, logits), 5))
            print(
                f"example {index}: "
                + ", ".join(
                    f"{name} {res['agree'][-1]:.0f}/{res['kl'][-1]:.3f}"
                    for name, res in results.items()
                ),
                flush=True,
            )
    print(f"\n{engine.model_id} {args.dtype}, {args.examples} examples\n")
    print(
        "| variant | first-token agreement | first-token KL vs full (mean) | KL (median) |\n"
        "|---|---:|---:|---:|"
    )
    for name, res in results.items():
        print(
            f"| {name} | {statistics.fmean(res['agree']):.0%} | {statistics.fmean(res['kl']):.3f} "
            f"| {statistics.median(res['kl']):.3f} |"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "model": engine.model_id,
                    "dtype": args.dtype,
                    "examples": args.examples,
                    "results": results,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
