"""`kvblend ingest FILE.jsonl`: precompute documents' chunk KV so first requests
already hit the store.

Two targets:
  --url URL   POST batches to a running server's /v1/chunks (its store, its tenant namespace for the
              key);
  (default)   load the model in-process and write into the store the config describes — only
              useful
              with a persistent tier (disk / redis) that the server later reads.

Each line is {"text": ..., "id": ...} ("content" / "contents" / "document" also
accepted) or a JSON string.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

TEXT_FIELDS = ("text", "content", "contents", "document")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="JSONL: one document per line")
    p.add_argument(
        "--url", help="a running kvblend server (e.g. http://127.0.0.1:8000); default: in-process"
    )
    p.add_argument("--api-key", help="bearer key for --url (default: KVBLEND_CLIENT_API_KEY)")
    p.add_argument("--config", help="server config (in-process: model and store settings)")
    p.add_argument("--model", help="model id (default: the first configured model)")
    p.add_argument(
        "--namespace", default="", help="tenant namespace (in-process only; --url uses the key's)"
    )
    p.add_argument(
        "--batch-size", type=int, default=16, help="documents per request / precompute call"
    )
    p.add_argument("--output", help="write one JSON line per document: id, num_tokens, cached, key")


def read_documents(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if isinstance(item, str):
                item = {"text": item}
            text = next(
                (
                    item[k]
                    for k in TEXT_FIELDS
                    if isinstance(item, dict) and isinstance(item.get(k), str)
                ),
                None,
            )
            if not text:
                raise ValueError(
                    f"{path}:{n}: no non-empty text field (one of {', '.join(TEXT_FIELDS)})"
                )
            doc = {"text": text}
            if item.get("id") is not None:
                doc["id"] = str(item["id"])
            yield doc


def _batches(items: list[dict], size: int) -> Iterator[list[dict]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _remote(args, batches: Iterator[list[dict]]) -> Iterator[list[dict]]:
    import httpx

    from kvblend.config import client_env_overrides

    key = args.api_key or client_env_overrides().get("api_key", "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=600) as http:
        for batch in batches:
            body: dict = {"documents": batch}
            if args.model:
                body["model"] = args.model
            r = http.post("/v1/chunks", json=body)
            if r.status_code != 200:
                try:
                    msg = r.json()["error"]["message"]
                except Exception:
                    msg = r.text[:300]
                raise ValueError(f"{args.url}/v1/chunks answered {r.status_code}: {msg}")
            yield r.json()["data"]


def _local(args, batches: Iterator[list[dict]]) -> Iterator[list[dict]]:
    import logging

    from kvblend.engine.engine import create_engine
    from kvblend.server.backends import document_id
    from kvblend.settings import load_server_config
    from kvblend.store.factory import create_store

    config = load_server_config(args.config)
    entries = [
        m for m in config.models if m.kind == "local" and (not args.model or m.id == args.model)
    ]
    if not entries:
        raise ValueError(f"no local model {args.model!r} in the config")
    if config.store.tiers == ("memory",):
        logging.getLogger(__name__).warning(
            "the store is memory-only: ingested KV is lost when this command exits"
        )
    store = create_store(config.store)
    engine = create_engine(entries[0].engine_config(), store)
    try:
        for batch in batches:
            ids = [engine.segments(documents=[d["text"]], question="").chunk_ids[0] for d in batch]
            infos = engine.precompute(ids, namespace=args.namespace)
            yield [{"id": d.get("id") or document_id(d["text"]), **i} for d, i in zip(batch, infos)]
    finally:
        for name in ("flush", "close"):  # persistent tiers may write in the background
            if hasattr(store, name):
                getattr(store, name)()


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")
    docs = list(read_documents(Path(args.file)))
    if not docs:
        raise ValueError(f"{args.file}: no documents")
    source = _remote if args.url else _local
    out = open(args.output, "w", encoding="utf-8") if args.output else None
    tokens = new = 0
    try:
        with tqdm(total=len(docs), unit="doc", desc="ingest") as bar:
            for infos in source(args, _batches(docs, args.batch_size)):
                for info in infos:
                    tokens += int(info["num_tokens"])
                    new += 0 if info.get("cached") else 1
                    if out:
                        out.write(json.dumps(info) + "\n")
                bar.update(len(infos))
                bar.set_postfix(tokens=tokens, new=new)
    finally:
        if out:
            out.close()
    print(
        f"ingested {len(docs)} documents ({tokens} tokens): {new} computed, "
        f"{len(docs) - new} already stored"
    )
    return 0
