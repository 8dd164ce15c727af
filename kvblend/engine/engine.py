"""The kvblend engine: run a prefill the planner (planner.py) laid out from the chunk store, decode.

One ``Engine`` per model. It is not thread-safe: a single worker (the scheduler, a CLI, a bench)
drives it. ``start`` prefills a request and samples its first token; ``step`` runs one batched
decode step over any number of live sequences. Store lookups and what is stored after the first
token belong to ``PrefillPlanner``; each sequence's text to its ``Detokenizer`` (detokenizer.py).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from kvblend.blend.blender import (
    KVCache,
    PrefillPlan,
    iter_prefill,
    run_prefill,
    run_to_end,
)
from kvblend.blend.buffers import BufferPool, typed_view
from kvblend.blend.rope import apply_rope, halves_repeat
from kvblend.blend.segmenter import Segments, build_segments, encode, render_template_halves
from kvblend.config import EngineConfig, validate_fidelity
from kvblend.engine.detokenizer import Detokenizer
from kvblend.engine.fidelity import (
    Calibration,
    FidelityController,
    Setting,
    calibration_path,
    family_default,
)
from kvblend.engine.planner import PrefillPlanner, account
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
from kvblend.policy import (
    DEFAULT_RATIO,
    Mode,
    PrefillPolicy,
    Selection,
    validate_lookahead_layers,
)
from kvblend.store.base import ChunkKV, KVStore
from kvblend.store.memory import MemoryStore
from kvblend.store.reader import KVReadError

log = logging.getLogger(__name__)

SHADOW_QUEUE = 4  # sampled requests waiting for a shadow full prefill; more are not sampled


class Sequence:
    """A request being generated: its KV cache, sampled tokens and streaming text state."""

    def __init__(self, request: GenerationRequest, cache: KVCache, stats: PrefillStats, tokenizer):
        self.request = request
        self.cache = cache
        self.stats = stats
        self.generated: list[int] = []
        self.generator = create_generator(request.sampling)
        self.finished = False
        self.finish_reason: str | None = None
        self.first_token_logits: torch.Tensor | None = None
        # the streamed text: emitted so far in .text (stop strings never included)
        self.detokenizer = Detokenizer(tokenizer, request.sampling.stop)
        self.pending: list[TokenEvent] = []  # events produced by start() not yet handed out
        # (to_store, fresh_k, fresh_v): chained segments whose KV the engine stores after the first
        # token is out (Engine.run_deferred); fresh_k [L, Hkv, T, d] is a pooled buffer until then.
        self.chained: tuple | None = None
        # The cache's pooled memory goes back when the sequence is dropped (finished, cancelled or
        # failed): nothing outside a Sequence holds its cache.
        weakref.finalize(self, cache.release)

    @property
    def text(self) -> str:
        return self.detokenizer.text

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
        self.tokenizer = loaded.tokenizer
        kernel, self.attention_kernel_reason = _rows_attention_kernel(config.model, loaded)
        self.ops = TransformerOps(loaded.hf_model, rows_attention=kernel)
        # "amx" / "avx512bf16" / "avx2" / "torch"; the reason is None when this CPU's best native
        # build runs
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
        # KV caches and prefill workspaces are recycled: fresh memory costs a page fault per 4 KiB
        # written.
        self.buffers = BufferPool(config.buffer_pool_bytes)
        # Store lookups, prefix chains, missing chunks computed after the first token.
        self.planner = PrefillPlanner(
            config,
            self.ops,
            store,
            self.fingerprint,
            self.chunk_context_ids,
            self.buffers,
            self._chunk_steps,
        )
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

    # ---- the planner's state, under the engine's names -----------------------------------------
    @property
    def store(self) -> KVStore:
        return self.planner.store

    @store.setter
    def store(self, store: KVStore) -> None:
        self.planner.store = store

    @property
    def _deferred(self) -> dict[str, list[int]]:
        return self.planner.deferred

    @_deferred.setter
    def _deferred(self, deferred: dict[str, list[int]]) -> None:
        self.planner.deferred = deferred

    @property
    def has_deferred(self) -> bool:
        return self.planner.has_deferred

    def run_deferred(self, budget_s: float | None = None) -> int:
        """Store pending chained KV, then compute and store chunks that earlier requests found
        missing: all, or for about ``budget_s`` seconds (a layer at a time; what is left resumes
        at the next call). Returns how many chunks were stored."""
        return self.planner.run_deferred(budget_s)

    # ---- prompts -------------------------------------------------------------------------------
    def segments(
        self, documents: list[str], question: str, instruction: str = "", system: str | None = None
    ) -> Segments:
        return build_segments(self.tokenizer, documents, question, instruction, system)

    # ---- chunk precompute ----------------------------------------------------------------------
    def chunk_key(self, chunk_ids: list[int], namespace: str = "") -> str:
        return self.planner.chunk_key(chunk_ids, namespace)

    def max_chunk_tokens(self) -> int | None:
        """The longest chunk whose KV the store can keep (None: no store limit)."""
        return self.planner.max_chunk_tokens()

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
        return run_to_end(self._chunk_steps(chunk_ids))

    def _chunk_steps(self, chunk_ids: list[int]) -> Generator[int, None, ChunkKV]:
        """``_compute_chunk`` a layer at a time (``iter_prefill``), for deferred chunks that are
        computed between decoding steps."""
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
            out = yield from iter_prefill(self.ops, plan, cache)
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
        # earlier chained KV first: this request may start with the same segments
        self.planner.store_chained()
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
            self.planner.pending_stores.append((seq, k_buffer))
        return seq

    def _resolve_choice(self, request: GenerationRequest) -> tuple[PrefillPolicy, Setting | None]:
        """The request's policy completed from BlendConfig; with a fidelity target (the request's,
        else the config's unless the request names a ratio or selection) the controller's
        setting."""
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
            chosen = asked
        chosen = self._complete(chosen)
        depth = validate_lookahead_layers(chosen.lookahead_layers)
        # A depth of the whole model or more is every layer: one spelling (0), so one chained-key
        # tag.
        return replace(
            chosen, lookahead_layers=0 if depth >= self.ops.num_layers else depth
        ), setting

    @property
    def default_policy(self) -> PrefillPolicy:
        """What a request naming no policy runs (without a fidelity target)."""
        return self._complete(PrefillPolicy())

    def _complete(self, policy: PrefillPolicy) -> PrefillPolicy:
        """``policy``'s fields left None taken from BlendConfig, then selection auto resolved:
        the family's measured (selection, ratio), a ratio named by the request or the config
        winning. Any other selection with no ratio named runs DEFAULT_RATIO."""
        blend = self.config.blend
        policy = policy.with_defaults(
            blend.mode, blend.recompute_ratio, blend.selection, blend.lookahead_layers
        )
        if policy.selection == Selection.AUTO:
            kind, family_ratio = family_default(self.loaded.model_type)
            ratio = family_ratio if policy.ratio is None else policy.ratio
            return replace(policy, selection=Selection(kind), ratio=ratio)
        return policy if policy.ratio is not None else replace(policy, ratio=DEFAULT_RATIO)

    # ---- fidelity: shadow full prefills --------------------------------------------------------
    def _maybe_shadow(
        self, request: GenerationRequest, choice: PrefillPolicy, seq: Sequence
    ) -> None:
        """Queue one in ``fidelity_shadow_every`` fidelity-chosen blends for a shadow full
        prefill."""
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
        """Run one queued shadow full prefill (when idle) and record whether its first token
        (argmax) is the one the blend gave. Returns whether one ran."""
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
            plan, stored, to_store, loader = self.planner.plan(
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
        account(stats, stored, out.recomputed_rows, num_tokens)
        seq = Sequence(request, cache, stats, self.tokenizer)
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

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[TokenEvent | None]:
        """One decode step for every live sequence in ``seqs``, batched through the linear layers.

        A sequence whose ``pending`` event (from ``start``) is not handed out yet returns that
        instead."""
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
        last = len(seq.generated) >= params.max_tokens
        delta = seq.detokenizer.add(token_id, last)
        if seq.detokenizer.stopped:
            seq.finished, seq.finish_reason = True, "stop"
        elif last:
            seq.finished, seq.finish_reason = True, "length"
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
    ``cfg.attention_kernel`` allows it and it applies (on the CPU; bfloat16: AMX, else AVX512-BF16;
    float32: AVX2), else None (PyTorch kernels); reason: why it is not this CPU's best native build,
    or None. A kernel named in ``cfg.attention_kernel`` makes every reason it cannot run an error. A
    build that fails to compile or fails its self-check is logged as a warning: the engine then runs
    2-4x slower than it should."""
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
