"""`kvblend bench store`: load bandwidth of one RAG example's chunk KV from each store tier.

Synthesizes the KV of one MuSiQue-sized example (10 chunks of ~500-600 tokens) at the real shape of
SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, bf16), stores it in every tier, and times:
- ``get``: whole ChunkKVs, one chunk after another;
- ``layerwise``: ``open`` + LayerwiseLoader filling one [layers, kv_heads, T, d] prompt buffer;
next to plain memcpy of the same bytes (tensor clone / copy into the same buffer) in the same run.
Disk is measured with a hot page cache and cold (pages dropped with POSIX_FADV_DONTNEED).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_OUT = Path("bench/results/store.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--min-len", type=int, default=500)
    parser.add_argument("--max-len", type=int, default=600)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed repetitions per measurement (median reported)"
    )
    parser.add_argument(
        "--tiers", default="memory,disk,redis", help="comma list of tiers to measure"
    )
    parser.add_argument(
        "--dir", default=None, help="disk tier directory (default: a fresh temp dir, removed after)"
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="existing Redis to use (default: start redis-server on a free port)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: the loader is one thread beside compute; "
        "more threads on a busy box mostly add noise)",
    )
    parser.add_argument(
        "--e2e",
        action="store_true",
        help="also time blend@0.15 TTFT on the embedded model with the KV in each tier, "
        "with and without layer-by-layer pipelining",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)


def synth_chunks(
    n: int, min_len: int, max_len: int, layers: int, kv_heads: int, head_dim: int, seed: int = 0
) -> dict:
    """{key: ChunkKV} with k, v [layers, kv_heads, L, head_dim] bf16, L uniform in
    [min_len, max_len]."""
    import torch

    from kvblend.store.base import ChunkKV
    from kvblend.store.key import make_chunk_key

    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        shape = (layers, kv_heads, length, head_dim)
        kv = ChunkKV(
            torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16()
        )
        out[make_chunk_key("bench-synthetic", [], [seed, i, length], namespace="bench")] = kv
    return out


def tier_stores_for_bench(
    chunks: dict,
    tiers: tuple[str, ...] = ("memory", "disk", "redis"),
    *,
    disk_dir: str | os.PathLike | None = None,
    redis_url: str | None = None,
) -> dict:
    """One single-tier store per name, each already holding every chunk (writes flushed).

    Hook for the engine benchmark (blend TTFT with the KV in each tier): pass the engine's real
    ``{key: ChunkKV}``. Needs ``disk_dir`` for "disk" and ``redis_url`` for "redis". Budgets are
    sized to hold everything. Callers ``close()`` the stores.
    """
    from kvblend.config import StoreConfig
    from kvblend.store.factory import create_store

    total = sum(kv.nbytes for kv in chunks.values())
    stores = {}
    for name in tiers:
        cfg = StoreConfig(
            tiers=(name,),
            memory_bytes=2 * total + (1 << 20),
            disk_bytes=2 * total + (1 << 20),
            disk_dir=disk_dir,
            redis_url=redis_url or StoreConfig.redis_url,
            async_writes=False,
        )
        if name == "disk" and disk_dir is None or name == "redis" and redis_url is None:
            raise ValueError(f"tier {name!r} needs {'disk_dir' if name == 'disk' else 'redis_url'}")
        store = create_store(cfg)
        for key, kv in chunks.items():
            store.put(key, kv)
        store.flush()
        stores[name] = store
    return stores


def _median_s(
    fn: Callable[[], None], repeats: int, before: Callable[[], None] | None = None
) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _drop_page_cache(directory: Path) -> None:
    """Evict the tier's (clean, fsynced) file pages so the next read really hits the device."""
    for entry in os.scandir(directory):
        fd = os.open(entry.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _prompt_buffers(chunks: dict):
    """k_pre, v [layers, kv_heads, T, d] for all chunks back to back, and each chunk's first row."""
    import torch

    kvs = list(chunks.values())
    offsets, rows = [], 0
    for kv in kvs:
        offsets.append(rows)
        rows += kv.seq_len
    layers, heads, _, dim = kvs[0].k.shape
    k_pre = torch.empty((layers, heads, rows, dim), dtype=kvs[0].k.dtype)
    return k_pre, torch.empty_like(k_pre), offsets


def measure(chunks: dict, stores: dict, repeats: int, disk_dir: Path | None) -> list[dict]:
    """Rows of {tier, method, seconds, GB_per_s} for memcpy and every store."""
    from kvblend.engine.kv_loader import LayerwiseLoader

    total = sum(kv.nbytes for kv in chunks.values())
    k_pre, v_buf, offsets = _prompt_buffers(chunks)
    keys = list(chunks)

    def memcpy_clone() -> None:
        for kv in chunks.values():
            kv.k.clone(), kv.v.clone()

    def memcpy_into() -> None:
        for kv, off in zip(chunks.values(), offsets):
            k_pre[:, :, off : off + kv.seq_len].copy_(kv.k)
            v_buf[:, :, off : off + kv.seq_len].copy_(kv.v)

    def get_all(store) -> Callable[[], None]:
        def fn() -> None:
            for key in keys:
                assert store.get(key) is not None, f"bench store lost {key}"

        return fn

    def layerwise(store) -> Callable[[], None]:
        def fn() -> None:
            readers = [store.open(key) for key in keys]
            assert all(r is not None for r in readers), "bench store lost a key"
            with LayerwiseLoader(
                list(zip(readers, offsets)), k_pre, v_buf, close_readers=True
            ) as loader:
                loader.wait_all()

        return fn

    plans: list[tuple[str, str, Callable[[], None], Callable[[], None] | None]] = [
        ("memcpy", "clone", memcpy_clone, None),
        ("memcpy", "copy_into_prompt", memcpy_into, None),
    ]
    for name, store in stores.items():
        # The memory tier's get hands out the stored tensors themselves: its
        # "bandwidth" is a dict lookup.
        get_name = "get_zero_copy" if name == "memory" else "get"
        plans += [
            (name, get_name, get_all(store), None),
            (name, "layerwise", layerwise(store), None),
        ]
        if name == "disk" and disk_dir is not None:
            drop = lambda: _drop_page_cache(disk_dir)  # noqa: E731
            plans += [
                ("disk_cold", "get", get_all(store), drop),
                ("disk_cold", "layerwise", layerwise(store), drop),
            ]
    rows = []
    for tier, method, fn, before in plans:
        fn()  # warm-up: allocator, connections, page cache (for the hot rows)
        s = _median_s(fn, repeats, before)
        rows.append({"tier": tier, "method": method, "seconds": s, "GB_per_s": total / s / 1e9})
    return rows


def markdown(rows: list[dict], total_bytes: int) -> str:
    lines = [
        f"KV of one example: {total_bytes / 1e6:.1f} MB",
        "",
        "| tier | method | ms | GB/s |",
        "|---|---|---:|---:|",
    ]
    lines += [
        f"| {r['tier']} | {r['method']} | {r['seconds'] * 1e3:.2f} | {r['GB_per_s']:.2f} |"
        for r in rows
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvblend.store.local_redis import LocalRedisServer

    tiers = tuple(t.strip() for t in args.tiers.split(",") if t.strip())
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    chunks = synth_chunks(
        args.chunks,
        args.min_len,
        args.max_len,
        args.layers,
        args.kv_heads,
        args.head_dim,
        args.seed,
    )
    total = sum(kv.nbytes for kv in chunks.values())
    server = None
    tmp = None
    try:
        redis_url = args.redis_url
        if "redis" in tiers and redis_url is None:
            server = LocalRedisServer().start()
            redis_url = server.url
        disk_dir = Path(args.dir) if args.dir else None
        if "disk" in tiers and disk_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="kvblend-bench-store-")
            disk_dir = Path(tmp.name)
        stores = tier_stores_for_bench(chunks, tiers, disk_dir=disk_dir, redis_url=redis_url)
        try:
            rows = measure(chunks, stores, args.repeats, disk_dir if "disk" in tiers else None)
        finally:
            for s in stores.values():
                s.close()
        e2e_rows = measure_e2e(tiers, disk_dir, redis_url, args.repeats) if args.e2e else []
    finally:
        if server is not None:
            server.stop()
        if tmp is not None:
            tmp.cleanup()
    result = {
        "example": {
            "chunks": args.chunks,
            "chunk_lens": [kv.seq_len for kv in chunks.values()],
            "bytes": total,
            "shape": [args.layers, args.kv_heads, "L", args.head_dim],
            "dtype": "bfloat16",
        },
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
        "disk_note": "disk = hot page cache; disk_cold = pages dropped (fadvise)",
        "rows": rows,
        "e2e": e2e_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(rows, total))
    if e2e_rows:
        print(markdown_e2e(e2e_rows))
    print(f"\nwrote {args.out}")
    return 0


def measure_e2e(
    tiers: tuple[str, ...], disk_dir, redis_url, repeats: int, ratio: float = 0.15
) -> list[dict]:
    """Blend TTFT on a real MuSiQue example with its chunk KV (real, from the embedded
    model) in each tier."""
    import shutil

    from kvblend.bench.data import DEFAULT_INSTRUCTION, load_musique
    from kvblend.config import EngineConfig, ModelConfig
    from kvblend.engine.engine import create_engine
    from kvblend.engine.request import GenerationRequest, SamplingParams
    from kvblend.store.memory import MemoryStore

    engine = create_engine(EngineConfig(model=ModelConfig()), MemoryStore())
    # Every timed run must blend (select + recompute), not reuse the previous run's blended KV.
    engine.config.blend.store_blended_prefix = False
    ex = load_musique(limit=1)[0]
    segs = engine.segments(
        ex.passages, f"Question: {ex.question}", instruction=DEFAULT_INSTRUCTION + "\n\n"
    )
    request = GenerationRequest(
        segs, SamplingParams(max_tokens=1), mode="blend", recompute_ratio=ratio
    )
    engine.run(request)  # computes and stores every chunk and the prefix
    chunks = {key: engine.store.get(key) for key, _ in engine.store.entries()}
    if disk_dir is not None:  # a fresh directory for the real chunks
        disk_dir = Path(disk_dir) / "e2e"
        shutil.rmtree(disk_dir, ignore_errors=True)
    stores = tier_stores_for_bench(chunks, tiers, disk_dir=disk_dir, redis_url=redis_url)
    rows = []
    try:
        for name, store in stores.items():
            engine.store = store
            for pipelined in (True, False):
                engine.config.pipeline_loads = pipelined
                engine.run(request)  # warm-up (page cache, connections)
                ttfts = [engine.run(request).stats.ttft_ms for _ in range(repeats)]
                rows.append(
                    {
                        "tier": name,
                        "pipelined": pipelined,
                        "prompt_tokens": segs.num_tokens,
                        "ttft_ms": round(statistics.median(ttfts), 2),
                    }
                )
    finally:
        for s in stores.values():
            s.close()
    base = next((r["ttft_ms"] for r in rows if r["tier"] == "memory" and r["pipelined"]), None)
    for r in rows:
        r["vs_memory_pipelined"] = round(r["ttft_ms"] / base, 3) if base else None
    return rows


def markdown_e2e(rows: list[dict]) -> str:
    lines = [
        "",
        f"blend@0.15 TTFT, embedded model (bf16), {rows[0]['prompt_tokens']} prompt "
        "tokens, KV in each tier:",
        "",
        "| tier | pipelined | median TTFT (ms) | vs memory (pipelined) |",
        "|---|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tier']} | {'yes' if r['pipelined'] else 'no'} | {r['ttft_ms']:.1f} | "
            f"{r['vs_memory_pipelined']:.2f}x |"
        )
    return "\n".join(lines)
