"""The kvblend engine: plan a prefill per mode from the chunk store, run it, decode.

One ``Engine`` per model. It is not thread-safe: a single worker (the scheduler, a CLI, a bench) drives
it. ``start`` prefills a request and samples its first token; ``step`` runs one batched decode step
over any number of live sequences.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvblend.blend.blender import KVCache, PrefillPlan, run_prefill
from kvblend.blend.buffers import BufferPool, typed_view
from kvblend.blend.rope import apply_rope, halves_repeat
from kvblend.blend.segmenter import (
    Segments,
    build_segments,
    build_segments_from_messages,
    encode,
    render_template_halves,
)
from kvblend.blend.selection import num_to_keep
from kvblend.blend.strategies import create_selection
from kvblend.config import EngineConfig, validate_fidelity
from kvblend.engine.fidelity import (
    AUTO_FALLBACK,
    FAMILY_DEFAULTS,
    Calibration,
    FidelityController,
    Setting,
    calibration_path,
)
from kvblend.engine.kv_loader import LayerwiseLoader, load_sync
from kvblend.engine.request import (
    ContextLengthError,
    GenerationRequest,
    GenerationResult,
    PrefillStats,
    SamplingParams,
    TokenEvent,
)
from kvblend.engine.sampler import create_generator, sample, token_logprobs
from kvblend.kernels import (
    KERNELS_BY_NAME,
    KernelUnavailable,
    dtype_name,
    kernels_for,
    select_rows_attention,
)
from kvblend.models.loader import EMBEDDED_MODEL_ID, LoadedModel, load_model
from kvblend.models.transformer import TransformerOps
from kvblend.policy import Mode, PrefillPolicy, Selection, validate_lookahead_layers
from kvblend.store.base import ChunkKV, KVStore
from kvblend.store.key import make_chunk_key, make_prefix_key
from kvblend.store.memory import MemoryStore
from kvblend.store.reader import KVReader, KVReadError, TensorReader

log = logging.getLogger(__name__)

SHADOW_QUEUE = 4  # sampled requests waiting for a shadow full prefill; more are not sampled


@dataclass
class _StoredSegment:
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


class Sequence:
    """A request being generated: its KV cache, sampled tokens and streaming text state."""

    def __init__(self, request: GenerationRequest, cache: KVCache, stats: PrefillStats):
        self.request = request
        self.cache = cache
        self.stats = stats
        self.generated: list[int] = []
        self.generator = create_generator(request.sampling)
        self.finished = False
        self.finish_reason: str | None = None
        self.first_token_logits: torch.Tensor | None = None
        self.text = ""  # text emitted so far (stop strings never included)
        self.pending: list[TokenEvent] = []  # events produced by start() not yet handed out
        # (to_store, fresh_k, fresh_v): chained segments whose KV the engine stores after the first
        # token is out (Engine.run_deferred); fresh_k [L, Hkv, T, d] is a pooled buffer until then.
        self.chained: tuple | None = None
        # The cache's pooled memory goes back when the sequence is dropped (finished, cancelled or failed):
        # nothing outside a Sequence holds its cache.
        weakref.finalize(self, cache.release)

    def result(self) -> GenerationResult:
        return GenerationResult(
            list(self.generated),
            self.text,
            self.finish_reason or "length",
            self.stats,
            self.first_token_logits,
        )


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, store: KVStore):
        self.config = config
        self.loaded = loaded
        self.store = store
        self.tokenizer = loaded.tokenizer
        kernel, self.attention_kernel_reason = _rows_attention_kernel(config.model, loaded)
        self.ops = TransformerOps(loaded.hf_model, rows_attention=kernel)
        # "amx" / "avx512bf16" / "avx2" / "torch"; the reason is None when this CPU's best native build runs
        self.attention_kernel = kernel.name if kernel is not None else "torch"
        self.fingerprint = loaded.fingerprint
        self.model_id = _model_id(config.model.model, loaded)
        self.max_context_len = self.ops.max_position_embeddings
        self.vocab_size = int(self.ops.embed_tokens.weight.shape[0])  # token ids must be below this
        # Chunks are prefilled behind this context; it is part of every chunk key.
        ctx_text = config.chunk_context
        if ctx_text is None:
            ctx_text = render_template_halves(self.tokenizer, system=None)[0]
        self.chunk_context_ids = encode(self.tokenizer, ctx_text)
        self.eos_ids = _eos_ids(loaded)
        # KV caches and prefill workspaces are recycled: fresh memory costs a page fault per 4 KiB written.
        self.buffers = BufferPool(config.buffer_pool_bytes)
        # Chunks a request found missing: computed alone after its first token (run_deferred), so a
        # cold request costs one normal prefill and the next request with these chunks hits.
        self._deferred: dict[str, list[int]] = {}
        # (sequence, its K workspace buffer): chained KV to store once the first token is out.
        self._pending_stores: list[tuple[Sequence, object]] = []
        self.calibration_path = config.calibration_path or calibration_path(
            config.model.cache_dir, loaded.model_dir, config.model.dtype
        )
        self.fidelity = FidelityController(self._load_calibration())
        self._shadow: deque = deque()  # (segments, namespace, choice, blend's first-token argmax)
        self._shadow_count = 0

    def _load_calibration(self) -> Calibration | None:
        """This model's calibration, if one was measured for these weights and dtype."""
        cal = Calibration.load(self.calibration_path)
        if cal is not None and (
            cal.fingerprint != self.fingerprint or cal.dtype != self.config.model.dtype
        ):
            log.warning(
                "ignoring %s: measured on other weights or another dtype", self.calibration_path
            )
            return None
        return cal

    def reload_calibration(self) -> None:
        self.fidelity = FidelityController(self._load_calibration())

    # ---- prompts -------------------------------------------------------------------------------
    def segments(
        self, documents: list[str], question: str, instruction: str = "", system: str | None = None
    ) -> Segments:
        return build_segments(self.tokenizer, documents, question, instruction, system)

    def segments_from_messages(
        self, messages: list[dict], documents: list[str] | None = None
    ) -> Segments:
        """OpenAI chat messages -> segments (``segmenter.build_segments_from_messages``)."""
        return build_segments_from_messages(self.tokenizer, messages, documents)

    # ---- chunk precompute ----------------------------------------------------------------------
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

    def precompute(self, chunks: list[list[int]], namespace: str = "") -> list[dict]:
        """Compute and store the KV of each chunk not already stored. Returns one dict per chunk."""
        out = []
        for ids in chunks:
            key = self.chunk_key(ids, namespace)
            cached = self.store.contains(key)
            if not cached:
                self.store.put(key, self._compute_chunk(ids))
            out.append({"key": key, "num_tokens": len(ids), "cached": cached})
        return out

    @torch.inference_mode()
    def _compute_chunk(self, chunk_ids: list[int]) -> ChunkKV:
        """KV of a chunk prefilled alone behind the chunk context (whose KV is dropped)."""
        ctx = self.chunk_context_ids
        total = len(ctx) + len(chunk_ids)
        if not chunk_ids:
            raise ValueError("empty chunk")
        if total > self.max_context_len:
            raise ValueError(
                f"chunk of {len(chunk_ids)} tokens (+{len(ctx)} context) exceeds the "
                f"context window of {self.max_context_len} tokens"
            )
        ids = torch.tensor(ctx + list(chunk_ids), dtype=torch.long)
        cache = KVCache.allocate(self.ops, total, self.buffers)
        k_buffer = self.buffers.take(cache.k.nbytes, self.ops.device)
        try:
            k_work = typed_view(k_buffer, _rows_shape(cache, total), self.ops.dtype)
            plan = PrefillPlan(
                ids, k_work, None, torch.zeros(total, dtype=torch.bool), torch.arange(total)
            )
            out = run_prefill(self.ops, plan, cache)
            # [L, Hkv, len(chunk), d], contiguous copies: the working buffers go back to the pool.
            return ChunkKV(
                out.fresh_k[:, :, len(ctx) :].clone(), out.fresh_v[:, :, len(ctx) :].clone()
            )
        finally:
            self.buffers.give(k_buffer)
            cache.release()

    # ---- prefill + decode ----------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, request: GenerationRequest) -> Sequence:
        """Prefill ``request`` and sample its first token (available via ``step`` / ``pending``)."""
        self._store_chained()  # earlier chained KV: this request may start with the same segments
        t0 = time.perf_counter()
        choice, setting = self._resolve_choice(request)
        segs = request.segments
        num_tokens = segs.num_tokens
        if num_tokens == 0:
            raise ValueError("empty prompt: at least one token is required")
        max_new = request.sampling.max_tokens
        if num_tokens + max_new > self.max_context_len:
            raise ContextLengthError(num_tokens, self.max_context_len, max_new)
        cache = KVCache.allocate(self.ops, num_tokens + max_new, self.buffers)
        k_buffer = self.buffers.take(cache.k[:, :, :num_tokens].nbytes, self.ops.device)
        k_work = typed_view(k_buffer, _rows_shape(cache, num_tokens), self.ops.dtype)
        try:
            seq = self._prefill(request, choice, cache, k_work, t0)
            if setting is not None:
                seq.stats.fidelity = {
                    "target": setting.target,
                    "expected_agreement": setting.expected_agreement,
                    "source": setting.source,
                }
                self._maybe_shadow(request, choice, seq)
        except BaseException:
            cache.release()
            self.buffers.give(k_buffer)
            raise
        if seq.chained is None:
            self.buffers.give(
                k_buffer
            )  # the pre-RoPE K workspace: nothing reads it past the prefill
        else:  # stored by run_deferred (the scheduler's, once the token is out) or the next start()
            self._pending_stores.append((seq, k_buffer))
        return seq

    def _store_chained(self) -> None:
        """Store the chained segments of finished prefills (copies of up to the whole prompt's K
        and V, kept off the TTFT), then give their K workspaces back."""
        while self._pending_stores:
            seq, k_buffer = self._pending_stores.pop(0)
            to_store, fresh_k, fresh_v = seq.chained
            seq.chained = None
            try:
                for key, start, end in to_store:
                    kv = ChunkKV(fresh_k[:, :, start:end].clone(), fresh_v[:, :, start:end].clone())
                    self.store.put(key, kv)
            finally:
                self.buffers.give(k_buffer)

    def _resolve_choice(self, request: GenerationRequest) -> tuple[PrefillPolicy, Setting | None]:
        """The request's policy completed from BlendConfig; with a fidelity target (the request's, else
        the config's unless the request names a ratio or selection) the controller's setting."""
        blend, asked = self.config.blend, request.policy
        mode = asked.mode or Mode(blend.mode)
        target = validate_fidelity(request.fidelity)
        if target is not None and (asked.ratio is not None or asked.selection is not None):
            raise ValueError("give either fidelity or recompute_ratio / selection, not both")
        if target is None and asked.ratio is None and asked.selection is None:
            target = blend.fidelity
        setting = None
        if target is not None and mode in (Mode.BLEND, Mode.REUSE):
            setting = self.fidelity.choose(target)
            chosen = PrefillPolicy.from_fields(
                setting.mode, setting.ratio, setting.selection or Selection.DEVIATION
            )  # full: unused
        else:
            chosen = asked.with_defaults(
                mode, blend.recompute_ratio, blend.selection, blend.lookahead_layers
            )
            if (
                chosen.selection == Selection.AUTO
            ):  # the family's measured best; the request's ratio wins
                kind, family_ratio = FAMILY_DEFAULTS.get(self.loaded.model_type, AUTO_FALLBACK)
                chosen = replace(
                    chosen,
                    selection=Selection(kind),
                    ratio=family_ratio if asked.ratio is None else chosen.ratio,
                )
        chosen = chosen.with_defaults(
            mode, blend.recompute_ratio, blend.selection, blend.lookahead_layers
        )
        depth = validate_lookahead_layers(chosen.lookahead_layers)
        # A depth of the whole model or more is every layer: one spelling (0), so one chained-key tag.
        return replace(
            chosen, lookahead_layers=0 if depth >= self.ops.num_layers else depth
        ), setting

    # ---- fidelity: shadow full prefills --------------------------------------------------------
    def _maybe_shadow(
        self, request: GenerationRequest, choice: PrefillPolicy, seq: Sequence
    ) -> None:
        """Queue one in ``fidelity_shadow_every`` fidelity-chosen blends for a shadow full prefill."""
        every = self.config.blend.fidelity_shadow_every
        if choice.mode != "blend" or every == 0 or seq.first_token_logits is None:
            return
        self._shadow_count += 1
        if self._shadow_count % every == 0 and len(self._shadow) < SHADOW_QUEUE:
            top = int(seq.first_token_logits.argmax())
            self._shadow.append((request.segments, request.namespace, choice, top))

    @property
    def has_shadow(self) -> bool:
        return bool(self._shadow)

    @torch.inference_mode()
    def run_shadow(self) -> bool:
        """Run one queued shadow full prefill (when idle) and record whether its first token (argmax)
        is the one the blend gave. Returns whether one ran."""
        if not self._shadow:
            return False
        segs, namespace, choice, blend_top = self._shadow.popleft()
        full = GenerationRequest(
            segs, SamplingParams(max_tokens=1), mode="full", namespace=namespace
        )
        seq = self.start(full)
        agreed = int(seq.first_token_logits.argmax()) == blend_top
        self.fidelity.record(choice.selection_label, choice.ratio, agreed)
        seq.cache.release()
        return True

    def _prefill(
        self,
        request: GenerationRequest,
        choice: PrefillPolicy,
        cache: KVCache,
        k_work: torch.Tensor,
        t0: float,
    ) -> Sequence:
        """Plan, run the layer loop (once more if stored KV fails mid-read), sample the first token.
        k_work [L, Hkv, T, d]: pre-RoPE K of the prompt rows, stored rows loaded into it."""
        segs, num_tokens = request.segments, request.segments.num_tokens
        mode, ratio = choice.mode, choice.ratio
        bad: set[str] = set()  # failed mid-read: recomputed alone, then used exactly as a hit
        while True:
            stats = PrefillStats(
                mode=mode,
                recompute_ratio=ratio if mode == "blend" else (0.0 if mode == "reuse" else 1.0),
                selection=choice.selection_label if mode == "blend" else None,
                prompt_tokens=num_tokens,
                attention_kernel=self.attention_kernel,
                attention_kernel_reason=self.attention_kernel_reason,
            )
            plan, stored, to_store, loader = self._plan(
                segs, choice, request.namespace, stats, cache, k_work, bad
            )
            t_loaded = time.perf_counter()
            try:
                plan = plan.selection.prepare(self.ops, plan, cache)  # lookahead's reuse pass
                out = run_prefill(self.ops, plan, cache)
                break
            except KVReadError as e:  # an entry went bad mid-read: plan again without it
                failed = {s.key for s in stored if s.key and getattr(s.reader, "failed", False)}
                if not failed - bad:  # no reader owns the failure: stop trusting every stored entry
                    failed = {seg.key for seg in stored if seg.key}
                if not failed - bad:
                    raise
                log.warning(
                    "stored KV failed while loading (%s); recomputing %d entries",
                    e,
                    len(failed - bad),
                )
                bad |= failed
            finally:
                if loader is not None:
                    loader.close()
                for seg in stored:
                    seg.reader.close()
        self._account(stats, stored, out.recomputed_rows, num_tokens)
        seq = Sequence(request, cache, stats)
        seq.first_token_logits = out.last_logits
        first = sample(out.last_logits, request.sampling, seq.generator)
        event = self._append_token(seq, first, out.last_logits)
        t1 = time.perf_counter()
        stats.ttft_ms = (t1 - t0) * 1e3
        stats.load_ms = (t_loaded - t0) * 1e3
        stats.compute_ms = (t1 - t_loaded) * 1e3
        if to_store:  # chained segments (for requests that start alike): stored after the token
            seq.chained = (to_store, out.fresh_k, out.fresh_v)
        if event is not None:
            seq.pending.append(event)
        return seq

    def _plan(
        self,
        segs: Segments,
        choice: PrefillPolicy,
        namespace: str,
        stats: PrefillStats,
        cache: KVCache,
        k_work: torch.Tensor,
        bad: set[str] = frozenset(),
    ):
        """Look segments up in the store for ``choice.mode`` and build the layer-loop plan; stored K loads into
        ``k_work`` [L, Hkv, T, d], stored V into the cache.

        Returns (plan, stored segments, [(prefix key, row start, row end)] to store after the
        prefill, the loader filling the plan's stored rows layer by layer or None). Keys in ``bad``
        failed an earlier attempt: they are misses, and such chunks are computed alone now."""
        mode, ratio = choice.mode, choice.ratio
        ids = torch.tensor(segs.token_ids, dtype=torch.long)
        num_tokens = ids.numel()
        stats.chunks_total = len(segs.chunk_ids)
        if mode == "full":
            stored, to_store = [], []
        elif mode == "prefix":
            stored, to_store = self._lookup_prefix_chain(segs, namespace, bad)
        else:
            stored, to_store = self._lookup_chunks(segs, namespace, stats, choice.chain_tag, bad)
        stored_mask = torch.zeros(num_tokens, dtype=torch.bool)
        stored_k, stored_v, loader = k_work, None, None  # k_work also holds the fresh rows' K
        if stored:
            stored_v = cache.v[:, :, :num_tokens]  # values load straight into the attention cache
            sources = [(seg.reader, seg.row_start) for seg in stored]
            for seg in stored:
                stored_mask[seg.row_start : seg.row_start + seg.seq_len] = True
            if self.config.pipeline_loads:  # layer i+1 loads while layer i computes
                loader = LayerwiseLoader(sources, stored_k, stored_v)
            else:
                load_sync(sources, stored_k, stored_v)
        if mode == "blend":
            # Rows stored in their exact context (the prefix, earlier blends of the same leading
            # segments) are final; the other stored rows are chunk KV computed alone: candidates.
            exact = torch.zeros(num_tokens, dtype=torch.bool)
            for seg in stored:
                if seg.exact:
                    exact[seg.row_start : seg.row_start + seg.seq_len] = True
            active = (~exact).nonzero().flatten()
            layers, keep = self._check_schedule(ratio, int((stored_mask & ~exact).sum()))
            spans = tuple(
                (seg.row_start, seg.row_start + seg.seq_len) for seg in stored if not seg.exact
            )
        else:
            active = (~stored_mask).nonzero().flatten()
            layers, keep, spans = (), (), ()
        if active.numel() == 0 or int(active[-1]) != num_tokens - 1:
            # The last row's logits are the first token: it is always computed.
            active = torch.unique(torch.cat([active, torch.tensor([num_tokens - 1])]))
        plan = PrefillPlan(
            ids,
            stored_k,
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

    def _check_schedule(
        self, ratio: float, num_chunk_rows: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Check layers and how many chunk rows each keeps. Gradual filtering: the configured ratios,
        with the request's ratio as the last (never above an earlier one)."""
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

    def _lookup_prefix_chain(self, segs: Segments, namespace: str, bad: set[str] = frozenset()):
        """Longest run of whole segments from the start whose exact-context KV is stored."""
        stored, to_store, parent, row, hit = [], [], None, 0, True
        for kind, seg_ids in segs.segment_list():
            if kind == "query":
                break
            key = make_prefix_key(self.fingerprint, parent, seg_ids, namespace)
            parent = key
            reader = self._open(key, len(seg_ids), bad) if hit else None
            if reader is not None:
                stored.append(_StoredSegment(row, reader, True, key=key))
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
        """reuse / blend: the longest run of leading segments stored by an earlier request of the same
        mode and ratio (chained keys: that KV saw exactly these segments before it) is used as is;
        every later chunk comes by its position-independent key, computed alone now if missing (and
        stored, so the next request hits). The prefix segment's chain key is the exact one prefix
        mode uses, since a prefix is never recomputed."""
        stored, to_store, row, parent, chained = [], [], 0, None, True
        reuse_chain = self.config.blend.store_blended_prefix
        for kind, seg_ids in segs.segment_list():
            if kind == "query":
                break
            chained = chained and (kind == "prefix" or reuse_chain)
            key = make_prefix_key(
                self.fingerprint,
                parent,
                seg_ids,
                namespace if kind == "prefix" else f"{namespace}|{chain_tag}",
            )
            parent = key
            reader = self._open(key, len(seg_ids), bad) if chained else None
            if reader is not None:
                stats.chunks_hit += int(kind == "chunk")
                stored.append(_StoredSegment(row, reader, True, exact=True, key=key))
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
    ) -> _StoredSegment | None:
        """The stored chunk, or None when missing: its rows are then computed in context, like the
        query. A chunk whose entry was damaged is computed alone now (never deferred), so it is used
        exactly as its intact entry would have been: corruption costs time, never another answer."""
        key = self.chunk_key(chunk_ids, namespace)
        reader = self._open(key, len(chunk_ids), bad)
        if reader is not None:
            stats.chunks_hit += 1
            return _StoredSegment(row, reader, True, key=key)
        damaged = key in bad or bool(getattr(self.store, "was_discarded", lambda _: False)(key))
        if self.config.defer_missing_chunks and not damaged:
            self._deferred[key] = list(chunk_ids)
            return None
        kv = self._compute_chunk(chunk_ids)
        self.store.put(key, kv)
        return _StoredSegment(row, TensorReader(kv), False)

    @property
    def has_deferred(self) -> bool:
        return bool(self._deferred or self._pending_stores)

    @torch.inference_mode()
    def run_deferred(self, max_items: int | None = None) -> int:
        """Store pending chained KV, then compute and store chunks that earlier requests found
        missing. Returns how many chunks were computed."""
        self._store_chained()
        done = 0
        while self._deferred and (max_items is None or done < max_items):
            key, chunk_ids = next(iter(self._deferred.items()))
            del self._deferred[key]
            if not self.store.contains(key):
                self.store.put(key, self._compute_chunk(chunk_ids))
                done += 1
        return done

    def _open(self, key: str, num_tokens: int, bad: set[str] = frozenset()) -> KVReader | None:
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

    @staticmethod
    def _account(
        stats: PrefillStats,
        stored: list[_StoredSegment],
        recomputed_rows: torch.Tensor,
        num_tokens: int,
    ) -> None:
        hit_mask = torch.zeros(num_tokens, dtype=torch.bool)
        for seg in stored:
            if seg.is_hit:
                hit_mask[seg.row_start : seg.row_start + seg.seq_len] = True
        num_hit = int(hit_mask.sum())
        stats.recomputed_tokens = (
            int(hit_mask[recomputed_rows].sum()) if recomputed_rows.numel() else 0
        )
        stats.reused_tokens = num_hit - stats.recomputed_tokens
        stats.fresh_tokens = num_tokens - num_hit

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[TokenEvent | None]:
        """One decode step for every live sequence in ``seqs``, batched through the linear layers.

        A sequence whose ``pending`` event (from ``start``) is not handed out yet returns that instead."""
        events: list[TokenEvent | None] = [None] * len(seqs)
        live = []
        for i, s in enumerate(seqs):
            if s.pending:
                events[i] = s.pending.pop(0)
            elif not s.finished:
                live.append(i)
        if not live:
            return events
        batch = [seqs[i] for i in live]
        logits = self._decode_logits(batch)  # [B, vocab]
        for row, i in enumerate(live):
            s = seqs[i]
            token = sample(logits[row], s.request.sampling, s.generator)
            events[i] = self._append_token(s, token, logits[row])
        return events

    def _decode_logits(self, batch: list[Sequence]) -> torch.Tensor:
        ops = self.ops
        ids = torch.tensor([s.generated[-1] for s in batch], dtype=torch.long)
        lengths = [s.cache.length for s in batch]
        cos, sin = ops.rope_cos_sin(torch.tensor(lengths))  # [B, d]: each row at its own position
        halved = halves_repeat(cos, sin)  # once per step, not per layer
        h = ops.embed(ids)  # [B, D]
        for layer in range(ops.num_layers):
            q, k, v = ops.qkv(layer, h)  # [Hq, B, d], [Hkv, B, d]
            q, k = apply_rope(q, cos, sin, halved=halved), apply_rope(k, cos, sin, halved=halved)
            outs = []
            for b, s in enumerate(batch):  # attention per sequence: caches differ in length
                n = lengths[b]
                s.cache.k[layer, :, n] = k[:, b]
                s.cache.v[layer, :, n] = v[:, b]
                outs.append(
                    ops.decode_attend(
                        q[:, b], s.cache.k[layer, :, : n + 1], s.cache.v[layer, :, : n + 1]
                    )
                )
            h = ops.finish_layer(layer, h, torch.cat(outs))
        for s in batch:
            s.cache.length += 1
        return ops.logits(h)

    def _append_token(
        self, seq: Sequence, token_id: int, logits: torch.Tensor
    ) -> TokenEvent | None:
        """Record a token sampled from ``logits`` [vocab]; finish on EOS / stop token / stop string
        / max_tokens."""
        params = seq.request.sampling
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_ids
        ):
            seq.finished, seq.finish_reason = True, "stop"
            return None
        seq.generated.append(token_id)
        full = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        hold = 0
        for stop in params.stop:
            at = full.find(stop)
            if stop and at != -1:
                full, seq.finished, seq.finish_reason = full[:at], True, "stop"
                break
            hold = max(hold, _partial_suffix(full, stop))
        if not seq.finished and len(seq.generated) >= params.max_tokens:
            seq.finished, seq.finish_reason, hold = True, "length", 0
        if not seq.finished and full.endswith("\ufffd"):
            hold = max(hold, 1)  # an incomplete UTF-8 sequence: wait for the next token
        visible = full[: len(full) - hold] if hold else full
        delta = visible[len(seq.text) :] if visible.startswith(seq.text) else ""
        seq.text += delta
        event = TokenEvent(token_id, delta, len(seq.generated) - 1)
        if params.logprobs is not None:
            event.logprob, event.top_logprobs = token_logprobs(logits, token_id, params.logprobs)
        return event

    def generate(self, request: GenerationRequest) -> Iterator[TokenEvent | GenerationResult]:
        """Yield TokenEvents, then one GenerationResult."""
        seq = self.start(request)
        while seq.pending or not seq.finished:
            (event,) = self.step([seq])
            if event is not None:
                yield event
        yield seq.result()
        self.run_deferred()  # leaves the store warm for the next request

    def run(self, request: GenerationRequest) -> GenerationResult:
        result = None
        for item in self.generate(request):
            result = item
        return result


def _rows_shape(cache: KVCache, num_rows: int) -> tuple[int, int, int, int]:
    """[L, Hkv, num_rows, d]: a per-layer stack like the cache's, ``num_rows`` long."""
    layers, heads, _, dim = cache.k.shape
    return layers, heads, num_rows, dim


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop`` (held back)."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def _eos_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for src in (
        getattr(loaded.hf_model, "generation_config", None),
        loaded.hf_model.config,
        loaded.tokenizer,
    ):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids


def _model_id(model_ref: str, loaded: LoadedModel) -> str:
    """A readable id: the embedded model's name, a GGUF file's stem, or the weights dir's name."""
    if not model_ref:
        return EMBEDDED_MODEL_ID
    ref = Path(model_ref)
    return ref.stem if ref.suffix == ".gguf" else loaded.model_dir.name


def _rows_attention_kernel(cfg, loaded: LoadedModel):
    """(kernel, reason): the native attention kernel for the engine's dtype and head size when
    ``cfg.attention_kernel`` allows it and it applies (on the CPU; bfloat16: AMX, else AVX512-BF16; float32:
    AVX2), else None (PyTorch kernels); reason: why it is not this CPU's best native build, or None. A kernel
    named in ``cfg.attention_kernel`` makes every reason it cannot run an error. A build that fails to compile
    or fails its self-check is logged as a warning: the engine then runs 2-4x slower than it should."""
    if cfg.attention_kernel == "torch":
        return None, "attention_kernel=torch was asked for"
    hf_cfg = loaded.hf_model.config
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    dtype = getattr(torch, cfg.dtype)
    named = None if cfg.attention_kernel == "auto" else KERNELS_BY_NAME[cfg.attention_kernel]
    error = None
    if cfg.device != "cpu" or not kernels_for(dtype):
        error = KernelUnavailable(
            f"the native kernels run bfloat16 or float32 on the CPU (this engine: "
            f"{cfg.dtype} on {cfg.device})",
            "shape",
        )
    elif named is not None and named.dtype != dtype:
        error = KernelUnavailable(
            f"it runs {dtype_name(named.dtype)} only (this engine: {cfg.dtype})", "shape"
        )
    else:
        try:
            kernel, passed_over = select_rows_attention(
                cfg.cache_dir, dtype, None if named is None else named.name, head_dim
            )
            if passed_over is None:
                return kernel, None
            log.warning(
                "attention uses the %s kernel, not a faster build: %s", kernel.name, passed_over
            )
            return kernel, f"{kernel.name}, because {passed_over}"
        except KernelUnavailable as e:
            error = e
    if named is not None:
        raise ValueError(
            f"attention_kernel={cfg.attention_kernel}, but that kernel cannot be used: {error}"
        )
    level = logging.WARNING if error.is_defect or error.cause == "compiler" else logging.INFO
    log.log(level, "attention uses PyTorch kernels: the native kernel %s", error)
    return None, str(error)


def create_engine(config: EngineConfig | None = None, store: KVStore | None = None) -> Engine:
    config = config or EngineConfig()
    loaded = load_model(config.model)
    return Engine(config, loaded, store if store is not None else MemoryStore())
