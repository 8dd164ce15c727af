"""`kvblend store stats | ls | clear`: inspect the persistent chunk KV tiers (disk, redis).

The memory tier lives inside a serving process, so it is not visible from here; hit / miss counters
are this invocation's own (``stats --verify`` reads every entry, which makes ``corrupt`` meaningful).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("stats", "ls", "clear"), help="what to do")
    parser.add_argument("--dir", default=None, help="disk tier directory (default: <cache dir>/kv)")
    parser.add_argument("--redis-url", default=None, help="also inspect this Redis (default: none; env KVBLEND_REDIS_URL)")
    parser.add_argument("--redis-prefix", default="kvblend:", help="key prefix in Redis")
    parser.add_argument("--tier", choices=("all", "disk", "redis"), default="all", help="restrict to one tier")
    parser.add_argument("--verify", action="store_true", help="stats: read and checksum every entry (deletes corrupt ones)")
    parser.add_argument("--limit", type=int, default=50, help="ls: at most this many keys per tier (0: all)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _open_tiers(args: argparse.Namespace) -> dict:
    from kvblend.config import StoreConfig, load_env_overrides
    from kvblend.store.factory import create_tier

    env = load_env_overrides()
    redis_url = args.redis_url or env.get("redis_url")
    names = [n for n in ("disk", "redis") if args.tier in ("all", n)]
    if "redis" in names and not redis_url:
        if args.tier == "redis":
            raise ValueError("--tier redis needs --redis-url (or KVBLEND_REDIS_URL)")
        names.remove("redis")
    cfg = StoreConfig(tiers=tuple(names), disk_dir=args.dir or env.get("disk_dir"),
                      redis_url=redis_url or StoreConfig.redis_url, redis_prefix=args.redis_prefix)
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
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import json

    tiers = _open_tiers(args)
    try:
        if args.action == "stats":
            result = {name: _tier_stats(t, args.verify) for name, t in tiers.items()}
            cols = ["tier", "entries", "bytes", "hits", "misses", "evictions", "corrupt", "errors"]
            rows = [{"tier": n, **s} for n, s in result.items()]
        elif args.action == "ls":
            result = {}
            for name, t in tiers.items():
                listed = list(t.entries())
                result[name] = listed[: args.limit] if args.limit else listed
            cols = ["tier", "key", "bytes"]
            rows = [{"tier": n, "key": k, "bytes": b} for n, items in result.items() for k, b in items]
        else:
            result = {name: {"deleted": t.clear()} for name, t in tiers.items()}
            cols = ["tier", "deleted"]
            rows = [{"tier": n, **r} for n, r in result.items()]
        print(json.dumps(result, indent=2, default=str) if args.json else _table(rows, cols))
    finally:
        for t in tiers.values():
            t.close()
    return 0
