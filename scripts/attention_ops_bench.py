"""One layer's ops on a model's shapes, through the calls the engine makes, timed against each
other: PyTorch (SDPA as TorchAttention calls it), FlexAttention compiled for the CPU with a block
mask, and the native kernels (kvblend/kernels) built for the model's head size. Answers "which
should the engine keep for each op?" before anyone writes more intrinsics.

    .venv/bin/python scripts/attention_ops_bench.py [--shapes qwen1.5b,smollm2] [--tokens 6000]
        [--ratio 0.15] [--rounds 5] [--threads 2] [--no-flex]
        [--out bench/results/attention-ops-....json]

Shapes (random tensors; op timings do not depend on the values):
    qwen1.5b   12 query / 2 KV heads, head_dim 128, hidden 1536, MLP 8960 (Qwen2.5-1.5B)
    smollm2     9 query / 3 KV heads, head_dim 64, hidden 576, MLP 1536 (SmolLM2-135M)

Ops, per shape, each with RoPE of its queries and every key (what one layer's attention call does):
    full_prefill   every row, causal
    blend_rows     ``ratio`` of the rows scattered through the prompt (and the last), exact causal
                   by position
    decode         one row over the cache's rotated keys (no RoPE: the keys are already in the
                   cache)
    key_mass       lookahead's reuse pass: the last 32 rows, plus each key's attention summed over
                   them
    rms_norm / mlp on 128 rows (torch eager, torch.compile, native where the build has it)

Every candidate of an op runs once per round, the rounds interleaved, so a busy host slows them
alike; the JSON keeps each op's medians and the per-round times. The first call of each candidate
(builds, compilation) is timed apart as ``first_call_s``.
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

from kvblend.blend.blender import (  # noqa: E402
    KernelAttention,
    QueryAttentionRecorder,
    TorchAttention,
)
from kvblend.blend.rope import apply_rope  # noqa: E402
from kvblend.config import cpu_model_name, default_cache_dir  # noqa: E402
from kvblend.kernels import KernelUnavailable, select_rows_attention  # noqa: E402
from kvblend.models.transformer import TransformerOps  # noqa: E402

SHAPES = {
    "qwen1.5b": dict(
        num_heads=12, num_kv_heads=2, head_dim=128, hidden=1536, intermediate=8960, theta=1e6
    ),
    "smollm2": dict(
        num_heads=9, num_kv_heads=3, head_dim=64, hidden=576, intermediate=1536, theta=1e5
    ),
}
LOOKAHEAD_ROWS = 32
ROWWISE_ROWS = (
    128  # rms_norm / mlp rows: their cost is linear in rows, and the 1.5B MLP is ~3 ms a row here
)


def create_model(shape: dict) -> torch.nn.Module:
    """A one-layer random Qwen2 model of ``shape`` (bf16): TransformerOps over it make
    the engine's calls."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=1,
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        rope_theta=shape["theta"],
        max_position_embeddings=32768,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()


def flex_candidate(ops: TransformerOps, num_tokens: int, active: torch.Tensor, causal: bool):
    """RoPE + FlexAttention compiled for the CPU with a block mask of ``active`` rows'
    exact causal mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    positions = active.clone()

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= positions[q_idx]

    t0 = time.perf_counter()
    block_mask = create_block_mask(
        mask_mod, B=None, H=None, Q_LEN=active.numel(), KV_LEN=num_tokens, device="cpu"
    )
    mask_s = time.perf_counter() - t0
    attend = torch.compile(flex_attention, dynamic=False)
    cos, sin = ops.rope_cos_sin(torch.arange(num_tokens))

    def run(q, k_pre, v, k_cache):
        apply_rope(k_pre, cos, sin, out=k_cache)
        q_rot = apply_rope(q, cos[active], sin[active])
        out = attend(
            q_rot[None],
            k_cache[None],
            v[None],
            block_mask=block_mask,
            scale=ops.scaling,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).reshape(active.numel(), -1)

    return run, mask_s


def attention_candidates(ops_torch, ops_native, num_tokens, active, with_flex: bool):
    """{name: callable(q, k_pre, v, k_cache)} for one set of active rows, and notes
    (mask build time)."""
    cands, notes = {}, {}
    torch_attn = TorchAttention(ops_torch, num_tokens)
    cands["torch_sdpa"] = lambda q, k, v, kc: torch_attn(0, q, k, v, kc, active)
    if ops_native is not None:
        native = KernelAttention(ops_native, ops_native.rope_half_tables(num_tokens), num_tokens)
        cands["native"] = lambda q, k, v, kc: native(0, q, k, v, kc, active)
    if with_flex:
        try:
            run, notes["flex_block_mask_s"] = flex_candidate(ops_torch, num_tokens, active, False)
            cands["flex_compiled"] = run
        except Exception as e:  # noqa: BLE001 - the reason is the result
            notes["flex_error"] = f"{type(e).__name__}: {e}"[:500]
    return cands, notes


def key_mass_candidates(ops_torch, ops_native, num_tokens, active):
    """Lookahead's reuse pass: attention of ``active`` rows plus the attention
    every key receives."""
    cands = {}
    torch_attn = TorchAttention(ops_torch, num_tokens)

    def torch_run(q, k, v, kc):
        recorder = QueryAttentionRecorder(ops_torch, num_tokens)
        out = torch_attn(0, q, k, v, kc, active)
        recorder.add(q, kc, active)
        return out

    cands["torch_sdpa+recorder"] = torch_run
    if ops_native is not None and ops_native.rows_attention.has_key_mass:
        native = KernelAttention(ops_native, ops_native.rope_half_tables(num_tokens), num_tokens)

        def native_run(q, k, v, kc):
            mass = torch.zeros(num_tokens)
            return native(0, q, k, v, kc, active, key_mass=mass)

        cands["native"] = native_run
    return cands


def decode_candidates(ops_torch, ops_native):
    cands = {"torch_sdpa": lambda q, k, v: ops_torch.decode_attend(q, k, v)}
    if ops_native is not None and ops_native.rows_attention.has_decode:
        cands["native"] = lambda q, k, v: ops_native.decode_attend(q, k, v)
    return cands


def rowwise_candidates(ops_torch, ops_native, with_compile: bool):
    """RMSNorm and the MLP of the layer (HF modules eager / compiled; native norm + SiLU*up)."""
    layer = ops_torch.layers[0]
    norm, mlp = layer.input_layernorm, layer.mlp
    # kvblend's own MLP path (fused gate/up, + residual): PyTorch ops, or the native
    # SiLU*up / AMX projections
    cands = {
        "rms_norm": {"torch_eager": norm},
        "mlp": {"torch_eager": mlp, "kvblend_torch": lambda x: ops_torch._mlp(0, x, x)},
    }
    if with_compile:
        cands["rms_norm"]["torch_compile"] = torch.compile(norm, dynamic=False)
        cands["mlp"]["torch_compile"] = torch.compile(mlp, dynamic=False)
    if ops_native is not None and ops_native.rows_attention.has_elementwise:
        kernel = ops_native.rows_attention
        cands["rms_norm"]["native"] = lambda x: kernel.rms_norm(
            x, norm.weight, norm.variance_epsilon, torch.get_num_threads()
        )[0]
        cands["mlp"]["kvblend_native"] = lambda x: ops_native._mlp(0, x, x)
    return cands


def time_interleaved(cands: dict, make_args, rounds: int) -> dict:
    """{name: {"median_ms", "rounds_ms", "first_call_s"}}: one call of each candidate per round."""
    result = {name: {"rounds_ms": []} for name in cands}
    for name, fn in cands.items():
        t0 = time.perf_counter()
        fn(*make_args())
        result[name]["first_call_s"] = round(time.perf_counter() - t0, 3)
    for _ in range(rounds):
        for name, fn in cands.items():
            args = make_args()
            t0 = time.perf_counter()
            fn(*args)
            result[name]["rounds_ms"].append(round((time.perf_counter() - t0) * 1e3, 3))
    for r in result.values():
        r["median_ms"] = round(statistics.median(r["rounds_ms"]), 3)
    return result


def bench_shape(name: str, args) -> dict:
    shape = SHAPES[name]
    T, d, Hq, Hkv = args.tokens, shape["head_dim"], shape["num_heads"], shape["num_kv_heads"]
    try:
        kernel, passed_over = select_rows_attention(default_cache_dir(), torch.bfloat16, None, d)
        kernel_note = {
            "name": kernel.name,
            "head_dim": d,
            "passed_over": str(passed_over) if passed_over else None,
        }
    except KernelUnavailable as e:
        kernel, kernel_note = None, {"name": None, "reason": str(e)}
    model = create_model(shape)
    ops_torch = TransformerOps(model)
    ops_native = TransformerOps(model, rows_attention=kernel) if kernel is not None else None
    gen = torch.Generator().manual_seed(1)
    q_all = torch.randn(T, Hq, d, generator=gen).to(
        torch.bfloat16
    )  # [T, Hq, d] pre-RoPE, rows as projected
    k_pre = torch.randn(Hkv, T, d, generator=gen).to(torch.bfloat16)  # [Hkv, T, d]
    v = torch.randn(Hkv, T, d, generator=gen).to(torch.bfloat16)
    k_cache = torch.empty_like(k_pre)
    num_rows = max(1, int(args.ratio * T))
    scattered = torch.cat(
        [torch.randperm(T - 1, generator=gen)[: num_rows - 1].sort().values, torch.tensor([T - 1])]
    )
    tail = torch.arange(T - LOOKAHEAD_ROWS, T)
    ops = {}
    for op, active in (("full_prefill", torch.arange(T)), ("blend_rows", scattered)):
        cands, notes = attention_candidates(ops_torch, ops_native, T, active, args.flex)
        q = q_all[active].transpose(0, 1)  # [Hq, A, d] view, as ops.qkv returns it
        ops[op] = {
            "rows": active.numel(),
            **notes,
            **time_interleaved(cands, lambda: (q, k_pre, v, k_cache), args.rounds),
        }
        print(
            name,
            op,
            {c: r["median_ms"] for c, r in ops[op].items() if isinstance(r, dict)},
            flush=True,
        )
    q_tail = q_all[tail].transpose(0, 1)
    ops["key_mass"] = {
        "rows": LOOKAHEAD_ROWS,
        **time_interleaved(
            key_mass_candidates(ops_torch, ops_native, T, tail),
            lambda: (q_tail, k_pre, v, k_cache),
            args.rounds,
        ),
    }
    apply_rope(
        k_pre, *ops_torch.rope_cos_sin(torch.arange(T)), out=k_cache
    )  # decode reads rotated keys
    q_dec = q_all[-1]  # [Hq, d]
    ops["decode"] = {
        "rows": 1,
        **time_interleaved(
            decode_candidates(ops_torch, ops_native), lambda: (q_dec, k_cache, v), args.rounds * 4
        ),
    }
    x = torch.randn(ROWWISE_ROWS, shape["hidden"], generator=gen).to(torch.bfloat16)
    for op, cands in rowwise_candidates(ops_torch, ops_native, args.flex).items():
        ops[op] = {"rows": ROWWISE_ROWS, **time_interleaved(cands, lambda: (x,), args.rounds)}
    for op in ("key_mass", "decode", "rms_norm", "mlp"):
        print(
            name,
            op,
            {c: r["median_ms"] for c, r in ops[op].items() if isinstance(r, dict)},
            flush=True,
        )
    return {
        "shape": shape,
        "tokens": T,
        "ratio": args.ratio,
        "kernel": kernel_note,
        "ops": ops,
        # the lowest median per op; on a busy host read it with the rounds (what is
        # kept is in the docs)
        "fastest": {
            op: min(
                (c for c, r in res.items() if isinstance(r, dict)),
                key=lambda c: res[c]["median_ms"],
            )
            for op, res in ops.items()
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen1.5b,smollm2")
    p.add_argument("--tokens", type=int, default=6000)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--no-flex", dest="flex", action="store_false", help="skip FlexAttention / torch.compile"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    result = {
        "bench": "attention_ops",
        "torch": torch.__version__,
        "cpu": cpu_model_name(),
        "threads": args.threads,
        "rounds": args.rounds,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "shapes": {name: bench_shape(name, args) for name in args.shapes.split(",")},
    }
    out = (
        args.out or Path("bench/results") / f"attention-ops-{'-'.join(args.shapes.split(','))}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
