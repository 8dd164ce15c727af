"""`kvblend store stats | ls | clear`: inspect the chunk KV tiers a server with
the same config uses.

The tiers come from the server's config (``--config``, then KVBLEND_STORE_TIERS / _STORE_DIR /
_REDIS_URL, then ``--dir`` / ``--redis-url``). The memory tier lives inside a serving process, so it
is listed with its budget only (the server's ``/metrics`` has its counters); hit / miss counters are
this invocation's own (``stats --verify`` reads every entry, which makes ``corrupt`` meaningful).
"""

from __future__ import annotations

import argparse

PERSISTENT_TIERS = ("disk", "redis")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("stats", "ls", "clear"), help="what to do")
    parser.add_argument(
        "--config", default=None, help="the server's YAML/TOML config: use its store tiers"
    )
    parser.add_argument("--dir", default=None, help="disk tier directory (default: <cache dir>/kv)")
    parser.add_argument(
        "--redis-url",
        default=None,
        help="inspect this Redis too (default: the config's, or KVBLEND_REDIS_URL)",
    )
    parser.add_argument(
        "--redis-prefix", default=None, help="key prefix in Redis (default: kvblend:)"
    )
    parser.add_argument(
        "--tier", choices=("all", "disk", "redis"), default="all", help="restrict to one tier"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="stats: read and checksum every entry (deletes corrupt ones)",
    )
    parser.add_argument(
        "--limit", type=int, default=50, help="ls: at most this many keys per tier (0: all)"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def store_config(args: argparse.Namespace):
    """The StoreConfig a `kvblend serve` with the same config file and environment would use, with
    this command's flags on top. ``--dir`` / ``--redis-url`` add their tier; ``--tier disk``
    inspects the disk tier even when the server keeps chunks in memory only."""
    import dataclasses

    from kvblend.settings import load_server_config

    cfg = load_server_config(args.config).store
    tiers = list(cfg.tiers)
    for tier, flag in (("disk", args.dir), ("redis", args.redis_url)):
        if flag and tier not in tiers:
            tiers.append(tier)
    if args.tier in PERSISTENT_TIERS and args.tier not in tiers:
        if args.tier == "redis" and not args.redis_url:
            raise ValueError("--tier redis: this config has no Redis tier; pass --redis-url")
        tiers.append(args.tier)
    changes = {"tiers": tuple(tiers)}
    for name, value in (
        ("disk_dir", args.dir),
        ("redis_url", args.redis_url),
        ("redis_prefix", args.redis_prefix),
    ):
        if value:
            changes[name] = value
    return dataclasses.replace(cfg, **changes)


def _open_tiers(cfg, tier: str) -> dict:
    from kvblend.store.factory import create_tier

    names = [n for n in cfg.tiers if n in PERSISTENT_TIERS and tier in ("all", n)]
    return {n: create_tier(n, cfg) for n in names}


def _tier_stats(store, verify: bool) -> dict:
    """Counters plus entries / bytes counted from what the tier holds right now."""
    listed = list(store.entries())
    if verify:
        for key, _ in listed:
            store.get(key)
        listed = list(store.entries())
    out = store.stats()
    out.update(entries=len(listed), bytes=sum(n for _, n in listed))
    return out


def _table(rows: list[dict], cols: list[str]) -> str:
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines).rstrip()


def _memory_note(cfg) -> dict:
    from kvblend.store.describe import format_bytes

    return {
        "note": f"budget {format_bytes(cfg.memory_bytes)}, inside the serving process "
        "(its counters: the server's /metrics)"
    }


def _stats(tiers: dict, cfg, verify: bool) -> tuple[dict, list[dict], list[str]]:
    result = {}
    if "memory" in cfg.tiers:
        result["memory"] = _memory_note(cfg)
    result.update({name: _tier_stats(t, verify) for name, t in tiers.items()})
    cols = ["tier", "entries", "bytes", "hits", "misses", "evictions", "corrupt", "errors", "note"]
    rows = [{"tier": n, **s} for n, s in result.items()]
    return result, rows, cols


def _ls(tiers: dict, limit: int) -> tuple[dict, list[dict], list[str]]:
    result = {}
    for name, t in tiers.items():
        listed = list(t.entries())
        result[name] = listed[:limit] if limit else listed
    rows = [{"tier": n, "key": k, "bytes": b} for n, items in result.items() for k, b in items]
    return result, rows, ["tier", "key", "bytes"]


def run(args: argparse.Namespace) -> int:
    import json

    cfg = store_config(args)
    tiers = _open_tiers(cfg, args.tier)
    try:
        if args.action == "stats":
            result, rows, cols = _stats(tiers, cfg, args.verify)
        elif args.action == "ls":
            result, rows, cols = _ls(tiers, args.limit)
        else:
            result = {name: {"deleted": t.clear()} for name, t in tiers.items()}
            rows, cols = [{"tier": n, **r} for n, r in result.items()], ["tier", "deleted"]
        if args.json:
            print(json.dumps(result, indent=2, default=str))
        else:
            print(_table(rows, cols) if rows else "(no entries)")
    finally:
        for t in tiers.values():
            t.close()
    return 0
