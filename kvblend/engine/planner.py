"""The prefill planner: store lookups for a request's segments, and the layer-loop plan they make.

``PrefillPlanner`` owns what the engine reads from and writes to the chunk store: chunk and prefix-
chain keys, the lookups per mode (full / prefix / reuse / blend), the check-layer schedule, the
chunks a request found missing (computed alone after its first token: ``run_deferred``) and the
chained KV stored once a first token is out. The engine runs the plans it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from kvblend.blend.blender import KVCache, PrefillPlan, run_to_end
from kvblend.blend.buffers import BufferPool
from kvblend.blend.segmenter import Segments
from kvblend.blend.selection import num_to_keep
from kvblend.blend.strategies import create_selection
from kvblend.config import EngineConfig
from kvblend.engine.kv_loader import LayerwiseLoader, load_sync
from kvblend.engine.request import PrefillStats
from kvblend.models.transformer import TransformerOps
from kvblend.policy import PrefillPolicy
from kvblend.store.base import ChunkKV, KVStore
from kvblend.store.key import make_chunk_key, make_prefix_key
from kvblend.store.reader import KVReader, TensorReader


@dataclass
class StoredSegment:
    row_start: int
    reader: KVReader  # layer-by-layer access to the segment's stored KV
    is_hit: bool  # found in the store at request start (vs computed alone during this request)
    # Stored in the context of every segment before it (a prefix-chain hit): used as is, never
    # recomputed. Chunk KV computed alone is not exact and goes through selection.
    exact: bool = False
    key: str = ""  # the store key read (empty: computed during this request)

    @property
    def seq_len(self) -> int:
        return self.reader.seq_len


class PrefillPlanner:
    """Store lookups, prefix chains and deferred chunks for one engine (not thread-safe either).

    ``chunk_steps(ids)`` is the engine's: a chunk's KV prefilled alone behind the chunk
    context, a layer at a time (``iter_prefill``; it returns the ``ChunkKV``)."""

    def __init__(
        self,
        config: EngineConfig,
        ops: TransformerOps,
        store: KVStore,
        fingerprint: str,
        chunk_context_ids: list[int],
        buffers: BufferPool,
        chunk_steps: Callable[[list[int]], Generator[int, None, ChunkKV]],
    ):
        self.config = config
        self.ops = ops
        self.store = store
        self.fingerprint = fingerprint
        self.chunk_context_ids = chunk_context_ids
        self.buffers = buffers
        self.chunk_steps = chunk_steps
        # Chunks a request found missing: computed alone after its first token (run_deferred), so a
        # cold request costs one normal prefill and the next request with these chunks hits.
        self.deferred: dict[str, list[int]] = {}
        # (key, its computation so far): the deferred chunk a time-limited run_deferred left
        self.in_progress: tuple[str, Generator[int, None, ChunkKV]] | None = None
        # (sequence, its K workspace buffer): chained KV to store once the first token is out.
        self.pending_stores: list[tuple[object, object]] = []

    # ---- keys and limits -----------------------------------------------------------------------
    def chunk_key(self, chunk_ids: list[int], namespace: str = "") -> str:
        return make_chunk_key(self.fingerprint, self.chunk_context_ids, chunk_ids, namespace)

    def max_chunk_tokens(self) -> int | None:
        """The longest chunk whose KV the store can keep (None: no store limit), so a caller can
        refuse one that would be computed and then silently dropped."""
        limit = getattr(self.store, "max_entry_bytes", lambda: None)()
        if limit is None:
            return None
        ops = self.ops  # K and V: [layers, kv_heads, L, d] each
        itemsize = ops.embed_tokens.weight.element_size()
        per_token = 2 * ops.num_layers * ops.num_kv_heads * ops.head_dim * itemsize
        return int(limit) // per_token

    # ---- the plan ------------------------------------------------------------------------------
    def plan(
        self,
        segs: Segments,
        choice: PrefillPolicy,
        namespace: str,
        stats: PrefillStats,
        cache: KVCache,
        k_work: torch.Tensor,
        bad: set[str] = frozenset(),
    ) -> tuple[
        PrefillPlan, list[StoredSegment], list[tuple[str, int, int]], LayerwiseLoader | None
    ]:
        """Look segments up in the store for ``choice.mode`` and build the layer-loop plan; stored
        K loads into ``k_work`` [L, Hkv, T, d], stored V into the cache.

        Returns (plan, stored segments (their readers closed by the caller), [(prefix key, row
        start, row end)] to store after the prefill, the loader filling the plan's stored rows
        layer by layer or None). Keys in ``bad`` failed an earlier attempt: they are misses, and
        such chunks are computed alone now."""
        ids = torch.tensor(segs.token_ids, dtype=torch.long)
        num_tokens = ids.numel()
        stats.chunks_total = len(segs.chunk_ids)
        stored, to_store = self._lookup(segs, choice, namespace, stats, bad)
        stored_mask, stored_v, loader = self._load(stored, num_tokens, cache, k_work)
        active, layers, keep, spans = self._active_rows(choice, stored, stored_mask, num_tokens)
        plan = PrefillPlan(
            ids,
            k_work,  # k_work also holds the fresh rows' K
            stored_v,
            stored_mask,
            active,
            check_layers=layers,
            check_keep=keep,
            selection=create_selection(choice, deviation=self.config.blend.deviation),
            chunk_spans=spans,
            prefix_len=len(segs.prefix_ids),
            wait_layer=loader.wait_layer if loader else None,
        )
        return plan, stored, to_store, loader

    def _lookup(self, segs, choice: PrefillPolicy, namespace: str, stats, bad):
        if choice.mode == "full":
            return [], []
        if choice.mode == "prefix":
            return self._lookup_prefix_chain(segs, namespace, bad)
        return self._lookup_chunks(segs, namespace, stats, choice.chain_tag, bad)

    def _load(self, stored: list[StoredSegment], num_tokens: int, cache: KVCache, k_work):
        """(stored-row mask [T], the V rows stored KV loads into, the loader or None)."""
        stored_mask = torch.zeros(num_tokens, dtype=torch.bool)
        if not stored:
            return stored_mask, None, None
        stored_v = cache.v[:, :, :num_tokens]  # values load straight into the attention cache
        sources = [(seg.reader, seg.row_start) for seg in stored]
        for seg in stored:
            stored_mask[seg.row_start : seg.row_start + seg.seq_len] = True
        if self.config.pipeline_loads:  # layer i+1 loads while layer i computes
            return stored_mask, stored_v, LayerwiseLoader(sources, k_work, stored_v)
        load_sync(sources, k_work, stored_v)
        return stored_mask, stored_v, None

    def _active_rows(self, choice: PrefillPolicy, stored, stored_mask, num_tokens: int):
        """(rows computed from layer 0, check layers, rows each keeps, chunk spans)."""
        if choice.mode == "blend":
            # Rows stored in their exact context (the prefix, earlier blends of the same leading
            # segments) are final; the other stored rows are chunk KV computed alone: candidates.
            exact = torch.zeros(num_tokens, dtype=torch.bool)
            for seg in stored:
                if seg.exact:
                    exact[seg.row_start : seg.row_start + seg.seq_len] = True
            active = (~exact).nonzero().flatten()
            layers, keep = self.check_schedule(choice.ratio, int((stored_mask & ~exact).sum()))
            spans = tuple(
                (seg.row_start, seg.row_start + seg.seq_len) for seg in stored if not seg.exact
            )
        else:
            active = (~stored_mask).nonzero().flatten()
            layers, keep, spans = (), (), ()
        if active.numel() == 0 or int(active[-1]) != num_tokens - 1:
            # The last row's logits are the first token: it is always computed.
            active = torch.unique(torch.cat([active, torch.tensor([num_tokens - 1])]))
        return active, layers, keep, spans

    def check_schedule(
        self, ratio: float, num_chunk_rows: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Check layers and how many chunk rows each keeps. Gradual filtering: the configured
        ratios, with the request's ratio as the last (never above an earlier one)."""
        cfg = self.config.blend
        layers = tuple(l for l in cfg.check_layers if l < self.ops.num_layers)
        if not layers or num_chunk_rows == 0:
            return (), ()
        ratios = (
            list(cfg.check_ratios[: len(layers)]) if cfg.check_ratios else [ratio] * len(layers)
        )
        ratios[-1] = ratio
        ratios = [max(r, ratio) for r in ratios]  # shrinking schedule ending at the request's ratio
        return layers, tuple(num_to_keep(r, num_chunk_rows) for r in ratios)

    # ---- lookups -------------------------------------------------------------------------------
    def _lookup_prefix_chain(self, segs: Segments, namespace: str, bad: set[str] = frozenset()):
        """Longest run of whole segments from the start whose exact-context KV is stored."""
        stored, to_store, parent, row, hit = [], [], None, 0, True
        for kind, seg_ids in segs.segment_list():
            if kind == "query":
                break
            key = make_prefix_key(self.fingerprint, parent, seg_ids, namespace)
            parent = key
            reader = self.open(key, len(seg_ids), bad) if hit else None
            if reader is not None:
                stored.append(StoredSegment(row, reader, True, key=key))
            else:
                hit = False
                to_store.append((key, row, row + len(seg_ids)))
            row += len(seg_ids)
        return stored, to_store

    def _lookup_chunks(
        self,
        segs: Segments,
        namespace: str,
        stats: PrefillStats,
        chain_tag: str,
        bad: set[str] = frozenset(),
    ):
        """reuse / blend: the longest run of leading segments stored by an earlier request of the
        same mode and ratio (chained keys: that KV saw exactly these segments before it) is used as
        is; every later chunk comes by its position-independent key, computed alone now if missing
        (and stored, so the next request hits). The prefix segment's chain key is the exact one
        prefix mode uses, since a prefix is never recomputed."""
        stored, to_store, row, parent, chained = [], [], 0, None, True
        reuse_chain = self.config.blend.store_blended_prefix
        for kind, seg_ids in segs.segment_list():
            if kind == "query":
                break
            chained = chained and (kind == "prefix" or reuse_chain)
            tag = namespace if kind == "prefix" else f"{namespace}|{chain_tag}"
            key = make_prefix_key(self.fingerprint, parent, seg_ids, tag)
            parent = key
            reader = self.open(key, len(seg_ids), bad) if chained else None
            if reader is not None:
                stats.chunks_hit += int(kind == "chunk")
                stored.append(StoredSegment(row, reader, True, exact=True, key=key))
                row += len(seg_ids)
                continue
            chained = False
            if kind == "prefix" or reuse_chain:
                to_store.append((key, row, row + len(seg_ids)))
            if kind == "chunk":
                seg = self._chunk_segment(seg_ids, row, namespace, stats, bad)
                if seg is not None:
                    stored.append(seg)
            row += len(seg_ids)
        return stored, to_store

    def _chunk_segment(
        self,
        chunk_ids: list[int],
        row: int,
        namespace: str,
        stats: PrefillStats,
        bad: set[str] = frozenset(),
    ) -> StoredSegment | None:
        """The stored chunk, or None when missing: its rows are then computed in context, like the
        query. A chunk whose entry was damaged is computed alone now (never deferred), so it is
        used exactly as its intact entry would have been: corruption costs time, never another
        answer. A chunk still waiting in the deferred work is finished first: a request
        that repeats documents hits them, however far the work between turns got."""
        key = self.chunk_key(chunk_ids, namespace)
        self._finish_deferred(key)
        reader = self.open(key, len(chunk_ids), bad)
        if reader is not None:
            stats.chunks_hit += 1
            return StoredSegment(row, reader, True, key=key)
        damaged = key in bad or bool(getattr(self.store, "was_discarded", lambda _: False)(key))
        if self.config.defer_missing_chunks and not damaged:
            self.deferred[key] = list(chunk_ids)
            return None
        kv = run_to_end(self.chunk_steps(chunk_ids))
        self.store.put(key, kv)
        return StoredSegment(row, TensorReader(kv), False)

    def _finish_deferred(self, key: str) -> None:
        """Compute and store ``key`` now if it is deferred or half done."""
        if self.in_progress is not None and self.in_progress[0] == key:
            steps = self.in_progress[1]
            self.in_progress = None
            self.store.put(key, run_to_end(steps))
        elif key in self.deferred:
            chunk_ids = self.deferred.pop(key)
            if not self.store.contains(key):
                self.store.put(key, run_to_end(self.chunk_steps(chunk_ids)))

    def open(self, key: str, num_tokens: int, bad: set[str] = frozenset()) -> KVReader | None:
        """A reader for ``key`` if stored with the expected geometry; anything else is a miss."""
        if key in bad:
            return None
        reader = self.store.open(key)
        if reader is None:
            return None
        ops = self.ops
        if (reader.seq_len, reader.num_layers, reader.kv_heads, reader.head_dim, reader.dtype) != (
            num_tokens,
            ops.num_layers,
            ops.num_kv_heads,
            ops.head_dim,
            ops.dtype,
        ):
            reader.close()
            return None
        return reader

    # ---- after the first token -----------------------------------------------------------------
    @property
    def has_deferred(self) -> bool:
        return bool(self.deferred or self.pending_stores or self.in_progress)

    def store_chained(self) -> None:
        """Store the chained segments of finished prefills (copies of up to the whole prompt's K
        and V, kept off the TTFT), then give their K workspaces back."""
        while self.pending_stores:
            seq, k_buffer = self.pending_stores.pop(0)
            to_store, fresh_k, fresh_v = seq.chained
            seq.chained = None
            try:
                for key, start, end in to_store:
                    kv = ChunkKV(fresh_k[:, :, start:end].clone(), fresh_v[:, :, start:end].clone())
                    self.store.put(key, kv)
            finally:
                self.buffers.give(k_buffer)

    @torch.inference_mode()
    def run_deferred(self, budget_s: float | None = None) -> int:
        """Store pending chained KV, then compute and store chunks that earlier requests found
        missing: all of them, or with ``budget_s`` until that many seconds have passed (checked
        after each layer, so one layer always runs; a chunk left half done resumes at the next
        call). Returns how many chunks were stored."""
        self.store_chained()
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        done = 0
        while self.in_progress is not None or self.deferred:
            if self.in_progress is None:
                key, chunk_ids = next(iter(self.deferred.items()))
                del self.deferred[key]
                if self.store.contains(key):
                    continue
                self.in_progress = (key, self.chunk_steps(chunk_ids))
            key, steps = self.in_progress
            try:
                next(steps)
            except StopIteration as finished:  # no layer ran: go on with the next chunk
                self.in_progress = None
                self.store.put(key, finished.value)
                done += 1
                continue
            except BaseException:
                self.in_progress = None  # a failed chunk is only a later miss
                raise
            if deadline is not None and time.perf_counter() >= deadline:
                break
        return done


def account(
    stats: PrefillStats,
    stored: list[StoredSegment],
    recomputed_rows: torch.Tensor,
    num_tokens: int,
) -> None:
    """Fill ``stats``' reused / recomputed / fresh token counts from what the prefill read."""
    hit_mask = torch.zeros(num_tokens, dtype=torch.bool)
    for seg in stored:
        if seg.is_hit:
            hit_mask[seg.row_start : seg.row_start + seg.seq_len] = True
    num_hit = int(hit_mask.sum())
    stats.recomputed_tokens = int(hit_mask[recomputed_rows].sum()) if recomputed_rows.numel() else 0
    stats.reused_tokens = num_hit - stats.recomputed_tokens
    stats.fresh_tokens = num_tokens - num_hit
