"""The one layer loop every prefill mode runs through.

A ``PrefillPlan`` says which rows have stored KV and which rows are computed from layer 0; check
layers shrink the computed set to the rows whose KV deviates most. The modes are just plans:

    full    no stored rows, every row computed at every layer
    prefix  stored rows = the longest cached run of whole segments from the start (exact KV),
            rest computed
    reuse   stored rows = prefix + chunks, only uncached rows (the query) computed
    blend   stored rows = prefix + chunks; chunks + query computed until the check layer(s), then
            only the chunk rows the plan's selection strategy keeps (kvblend/blend/strategies.py:
            top KV deviation, top attention-output deviation after the check layer's attention, or
            top query attention) + query; lookahead's ``prepare`` ranks the rows by a reuse pass
            first and returns a plan with no check layer

Rows that are not computed at a layer use their stored pre-RoPE K (rotated to their new absolute
position) and V at that layer. Rows computed at a layer overwrite the stored rows with fresh K/V.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol, TypeVar

import torch

from kvblend.blend.buffers import BufferPool, typed_view
from kvblend.blend.rope import apply_rope, halves_repeat
from kvblend.blend.selection import causal_mask, query_attention
from kvblend.models.transformer import TransformerOps


@dataclass
class KVCache:
    """Attention cache of one sequence: post-RoPE keys and values, preallocated to ``capacity``.

    k, v: [num_layers, num_kv_heads, capacity, head_dim]; rows [0, length) are valid.
    """

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0
    # Where k and v live when they came from a pool: handed back by ``release``.
    _buffer: torch.Tensor | None = None
    _pool: BufferPool | None = None

    @classmethod
    def allocate(
        cls, ops: TransformerOps, capacity: int, pool: BufferPool | None = None
    ) -> "KVCache":
        shape = (ops.num_layers, ops.num_kv_heads, capacity, ops.head_dim)
        if pool is None:
            return cls(
                torch.empty(shape, dtype=ops.dtype, device=ops.device),
                torch.empty(shape, dtype=ops.dtype, device=ops.device),
            )
        stack = (
            math.prod(shape) * torch.empty(0, dtype=ops.dtype).element_size()
        )  # bytes of K (and of V)
        buf = pool.take(2 * stack, ops.device)
        return cls(
            typed_view(buf, shape, ops.dtype),
            typed_view(buf[stack:], shape, ops.dtype),
            0,
            buf,
            pool,
        )

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def release(self) -> None:
        """Hand pooled memory back; the cache is empty afterwards. Idempotent; a no-op if not
        pooled."""
        if self._pool is not None and self._buffer is not None:
            self._pool.give(self._buffer)
        self._buffer = None
        empty = self.k.new_empty((*self.k.shape[:2], 0, self.k.shape[3]))
        self.k, self.v, self.length = empty, empty, 0


class RowSelection(Protocol):
    """What the layer loop asks of a plan's token selection at a check layer. The strategies
    (kvblend/blend/strategies.py) implement it; this module does not import them, so they can run
    the layer loop themselves (lookahead's reuse pass)."""

    @property
    def after_attention(self) -> bool:
        """Check after the layer's attention (``check_attention``), not at its projections."""
        ...

    def check_qkv(self, ops, plan, layer, h, active, k_layer, v_layer, num_keep):
        """-> (q [Hq, K, d] pre-RoPE, kept local indices [K], kept hidden rows [K + pad, D]);
        writes the active rows' fresh K/V into k_layer / v_layer [Hkv, T, d]."""
        ...

    def check_attention(
        self, ops, plan, layer, attention, q, active, k_layer, v_layer, k_cache, num_keep
    ):
        """-> (kept local indices [K], their attention [K + pad, Hq * d])."""
        ...


@dataclass
class PrefillPlan:
    """The only thing that crosses from the engine's planning to the layer loop.

    Invariants: every row with ``stored_mask`` False is in ``active_rows``; ``active_rows`` is
    sorted and contains the last row (its logits are the first token); ``check_keep[i]`` is how many
    stored rows stay active after ``check_layers[i]`` (non-increasing).
    """

    token_ids: torch.Tensor  # [T] long
    stored_k: torch.Tensor | None  # [L, Hkv, T, d] pre-RoPE keys; valid where stored_mask
    stored_v: torch.Tensor | None  # [L, Hkv, T, d]; ideally a view of the cache's V rows (no copy)
    stored_mask: torch.Tensor  # [T] bool
    active_rows: torch.Tensor  # [A] long, rows computed from layer 0
    _: KW_ONLY  # the rest by name: several share a type, and a shifted positional would still run
    check_layers: tuple[int, ...] = ()
    check_keep: tuple[int, ...] = ()
    # Which rows a check layer keeps (a SelectionStrategy); needed only with check layers.
    selection: RowSelection | None = None
    # For deviation "attn": [start, end) rows of each stored chunk (the candidates), and how many
    # leading rows (the prompt's prefix) a chunk's local attention also sees, as it saw its cached
    # context.
    chunk_spans: tuple[tuple[int, int], ...] = ()
    prefix_len: int = 0
    # Sum, over layers, the attention the computed rows give every key
    # (PrefillOutput.query_attention): on a reuse plan those rows are the query, and the sums rank
    # the chunk rows for "lookahead".
    record_query_attention: bool = False
    # Run layers [0, num_layers) only (None: every layer). A shorter pass has no logits: it is only
    # for recording the query's attention (lookahead ranking from the first layers).
    num_layers: int | None = None
    # Pipelined loading: called before layer l's stored rows are first read; blocks until loaded.
    wait_layer: Callable[[int], None] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    def is_stored(self, rows: torch.Tensor) -> torch.Tensor:
        """[R] bool on rows' device: which of ``rows`` have stored KV."""
        return self.stored_mask.to(rows.device)[rows]


@dataclass
class PrefillOutput:
    last_logits: (
        torch.Tensor | None
    )  # [vocab] float32; None after a pass stopped early (plan.num_layers)
    fresh_k: torch.Tensor  # [L, Hkv, T, d] pre-RoPE keys: fresh where computed, stored elsewhere
    fresh_v: torch.Tensor
    recomputed_rows: torch.Tensor  # stored rows still active after the last check layer
    query_attention: torch.Tensor | None = None  # [T] float32, when the plan asked for it


# Hidden rows are padded to a multiple of this: oneDNN builds a matmul primitive per new row count
# (3-7 ms each, four shapes a layer), and without padding every request's recomputed set is a new
# count.
ROW_ALIGN = 16


_T = TypeVar("_T")


def run_prefill(ops: TransformerOps, plan: PrefillPlan, cache: KVCache) -> PrefillOutput:
    """Run the layer loop of ``plan``, filling ``cache`` rows [0, T). Returns last-token logits."""
    return run_to_end(iter_prefill(ops, plan, cache))


def run_to_end(steps: Generator[object, None, _T]) -> _T:
    """What a step-by-step computation (``iter_prefill``) returns, run without pausing."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def iter_prefill(
    ops: TransformerOps, plan: PrefillPlan, cache: KVCache
) -> Generator[int, None, PrefillOutput]:
    """``run_prefill`` a layer at a time: yields each layer's index once it is done, returns the
    output. Work that must not hold up decoding (a missing chunk computed after a request's first
    token) is advanced a few layers between decoding steps; nothing shared is held between two
    layers, so other prefills and decoding steps may run in between."""
    T = plan.num_tokens
    if cache.capacity < T:
        raise ValueError(f"cache capacity {cache.capacity} < prompt length {T}")
    num_layers = _layers_to_run(ops, plan)
    attention = create_attention(ops, T)
    k_pre, v_all = _working_buffers(ops, plan, cache)  # [L, Hkv, T, d] each; v_all is the cache's V
    active = plan.active_rows.to(ops.device)
    has_stored = bool(plan.stored_mask.any())
    checks = dict(zip(plan.check_layers, plan.check_keep))
    last_layer = ops.num_layers - 1
    token_ids = plan.token_ids.to(
        ops.device
    )  # indexed by active rows, which live on the model's device
    h = pad_rows(ops.embed(token_ids[active]))  # [A + pad, D]; rows past A are zeros, never read
    recomputed = active[plan.is_stored(active)].cpu()  # narrowed at check layers
    recorder = QueryAttentionRecorder(ops, T) if plan.record_query_attention else None
    for layer in range(num_layers):
        if has_stored and plan.wait_layer is not None:
            # Also when every row is computed (blend@1 after the check layer): fresh rows overwrite
            # stored ones in these buffers, so the loader must be done with the layer first.
            plan.wait_layer(layer)
        # A check narrows the rows at the layer's projections, or after its attention where the
        # strategy ranks by attention output (deviation "attn").
        attention_check = layer in checks and plan.selection.after_attention
        if layer in checks and not attention_check:  # the kept rows only, from this layer on
            q, keep, h = plan.selection.check_qkv(
                ops, plan, layer, h, active, k_pre[layer], v_all[layer], checks[layer]
            )
            active = active[keep]
            recomputed = active[plan.is_stored(active)].cpu()
        elif layer == 0 and has_stored:
            q = _first_layer_qkv(ops, plan, h, active, k_pre[0], v_all[0])
        else:
            q = _project_rows(ops, layer, h, active, k_pre[layer], v_all[layer])
        if layer == last_layer and active.numel() > 1:
            # Every row's K/V of this layer is written; only the last row's output (the logits) is
            # read.
            last = active.numel() - 1
            q, h, active = q[:, last:], h[last : last + 1], active[last:]
        if attention_check:  # o_proj and the MLP run for the kept rows only
            keep, attn = plan.selection.check_attention(
                ops,
                plan,
                layer,
                attention,
                q,
                active,
                k_pre[layer],
                v_all[layer],
                cache.k[layer, :, :T],
                checks[layer],
            )
            active, h = active[keep], pad_rows(h[keep])
            recomputed = active[plan.is_stored(active)].cpu()
        else:
            # [A, Hq * d]; the native kernel returns it with h's zero pad rows, ready for o_proj. A
            # kernel that sums key mass records the query's attention in the same call.
            key_mass = (
                recorder.total if recorder is not None and attention.records_key_mass else None
            )
            attn = attention(
                layer,
                q,
                k_pre[layer],
                v_all[layer],
                cache.k[layer, :, :T],
                active,
                h.shape[0],
                key_mass=key_mass,
            )
            if (
                recorder is not None and key_mass is None
            ):  # the call has just rotated the keys into the cache
                recorder.add(q, cache.k[layer, :, :T], active)
        h = ops.finish_layer(layer, h, pad_rows(attn, h.shape[0]))
        yield layer
    cache.length = T
    last_logits = (
        ops.logits(h[active.numel() - 1 : active.numel()])[0]
        if num_layers == ops.num_layers
        else None
    )
    return PrefillOutput(
        last_logits, k_pre, v_all, recomputed, recorder.total if recorder else None
    )


def _layers_to_run(ops: TransformerOps, plan: PrefillPlan) -> int:
    if plan.record_query_attention and plan.check_layers:
        raise ValueError(
            "record_query_attention is for plans without check layers (lookahead's reuse pass)"
        )
    if plan.check_layers and plan.selection is None:
        raise ValueError(
            "a plan with check layers needs a selection (kvblend/blend/strategies.py "
            "create_selection)"
        )
    if plan.num_layers is None or plan.num_layers == ops.num_layers:
        return ops.num_layers
    if not 1 <= plan.num_layers < ops.num_layers:
        raise ValueError(f"num_layers must be in [1, {ops.num_layers}], got {plan.num_layers}")
    if not plan.record_query_attention or plan.check_layers:
        raise ValueError(
            "a pass stopped before the last layer only records the query's attention "
            "(record_query_attention, no check layers)"
        )
    return plan.num_layers


class QueryAttentionRecorder:
    """Attention every key receives from the computed rows, summed over the layers ``add`` is called
    for, heads and rows. The kernels never materialise attention probabilities; this recomputes them
    for the few query rows."""

    def __init__(self, ops: TransformerOps, num_tokens: int):
        self.ops, self.num_tokens = ops, num_tokens
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        # [T]; a kernel with key mass (KernelAttention.records_key_mass) adds to it directly
        self.total = torch.zeros(num_tokens, dtype=torch.float32, device=ops.device)

    @property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, d] each; made at first use (not needed where the kernel records)."""
        if self._cos_sin is None:
            self._cos_sin = self.ops.rope_cos_sin(
                torch.arange(self.num_tokens, device=self.ops.device)
            )
        return self._cos_sin

    def add(self, q: torch.Tensor, keys: torch.Tensor, active: torch.Tensor) -> None:
        """q [Hq, A, d] pre-RoPE of rows ``active``; keys [Hkv, T, d] post-RoPE (the layer's
        cache)."""
        cos, sin = self.cos_sin
        q_rot = apply_rope(q, cos[active], sin[active])
        self.total += query_attention(q_rot, keys, active, self.ops.scaling)


def pad_rows(x: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
    """x [A, D] with zero rows appended up to ``num_rows`` (default: A rounded up to ROW_ALIGN)."""
    if num_rows is None:
        num_rows = -(-x.shape[0] // ROW_ALIGN) * ROW_ALIGN
    if num_rows == x.shape[0]:
        return x
    return torch.cat([x, x.new_zeros(num_rows - x.shape[0], x.shape[1])])


def create_attention(ops: TransformerOps, num_tokens: int):
    """The attention of one prefill: the native kernel where the model's ops carry it (CPU: AMX for
    bf16, AVX2 for fp32; RoPE tables of the repeated-half form), else PyTorch's SDPA kernels. Both
    are called as ``attention(layer, q, k_pre, v, k_cache, active)`` and also write the layer's
    rotated keys."""
    if ops.rows_attention is not None:
        tables = ops.rope_half_tables(num_tokens)
        if tables is not None:
            return KernelAttention(ops, tables, num_tokens)
    return TorchAttention(ops, num_tokens)


class KernelAttention:
    """One native call per layer: rotates every key into the cache, then attends the active rows
    with an exact causal mask by position (kvblend/kernels/rows_attention.c)."""

    head_subsets = (
        True  # q may carry any number of query heads per KV head (the kernel's GQA factor)
    )

    def __init__(
        self, ops: TransformerOps, rope_half: tuple[torch.Tensor, torch.Tensor], num_tokens: int
    ):
        self.ops, self.rope_half = ops, rope_half
        kernel = ops.rows_attention
        # packed K/V, reused by every layer so its pages are faulted in once per prefill
        self.scratch = torch.empty(
            kernel.scratch_bytes(num_tokens, ops.num_kv_heads), dtype=torch.uint8
        )
        self.num_threads = torch.get_num_threads()

    @property
    def records_key_mass(self) -> bool:
        """The bf16 builds also sum the attention each key receives (lookahead's reuse pass records
        it)."""
        return self.ops.rows_attention.has_key_mass

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k_pre: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        active: torch.Tensor,
        num_out_rows: int = 0,
        key_mass: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [H, A, d] pre-RoPE of rows ``active`` (H: the model's query heads, or any subset with
        the same count per KV head); k_pre, v, k_cache [Hkv, T, d]. Returns [A, H * d], or with
        ``num_out_rows`` > A that many rows, the ones past A zero (the hidden rows' padding).
        key_mass (``records_key_mass``): fp32 [T], += the attention probability each key receives,
        summed over the rows and heads."""
        ops = self.ops
        num_rows = q.shape[1]
        out = torch.empty(
            max(num_rows, num_out_rows), q.shape[0] * ops.head_dim, dtype=q.dtype, device=q.device
        )
        out[num_rows:].zero_()
        ops.rows_attention(
            q.transpose(0, 1),
            k_pre,
            v,
            k_cache,
            self.rope_half,
            active,
            ops.scaling,
            out[:num_rows],
            self.scratch,
            self.num_threads,
            key_mass=key_mass,
        )
        return out


class TorchAttention:
    """PyTorch kernels: causal SDPA when every row is active, else position blocks (``row_blocks``)
    of grouped queries through ``TransformerOps.attend_rows``."""

    head_subsets = False  # q carries every query head
    records_key_mass = False  # QueryAttentionRecorder.add recomputes the probabilities

    def __init__(self, ops: TransformerOps, num_tokens: int):
        self.ops = ops
        self.num_tokens = num_tokens
        positions = torch.arange(num_tokens, device=ops.device)
        self.cos, self.sin = ops.rope_cos_sin(positions)  # [T, d]
        self.halved = halves_repeat(self.cos, self.sin)
        self._blocks_for: torch.Tensor | None = None  # the active rows the cached blocks describe
        self._blocks: list[RowBlock] = []

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k_pre: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        active: torch.Tensor,
        num_out_rows: int = 0,
        key_mass: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As ``KernelAttention``, but returns [A, Hq * d] whatever ``num_out_rows`` (callers pad),
        and records no key mass (``records_key_mass`` is False: a caller passing it would lose the
        ranking)."""
        if key_mass is not None:
            raise ValueError(
                "TorchAttention does not record key mass; QueryAttentionRecorder.add does"
            )
        ops, cos, sin = self.ops, self.cos, self.sin
        # Keys of every row at their absolute positions; stored rows are re-positioned here.
        apply_rope(k_pre, cos, sin, out=k_cache, halved=self.halved)
        if active.numel() == self.num_tokens:
            return ops.attend(apply_rope(q, cos, sin, halved=self.halved), k_cache, v, None)
        if self._blocks_for is not active:  # rebuilt when the active set shrinks
            self._blocks_for, self._blocks = active, row_blocks(active)
        qg = grouped_queries(ops, q, cos[active], sin[active], self.halved)  # [Hkv, A * rep, d]
        return ops.attend_rows(qg, k_cache, v, self._blocks)


@dataclass
class RowBlock:
    """A run of active rows (sorted by position) attending keys [0, num_keys).

    Keys [0, split) precede every row of the block, so they need no mask; only the tail
    [split, num_keys) is masked, exactly causal by absolute position."""

    rows: slice  # local indices into the active rows
    split: int
    num_keys: int
    positions: torch.Tensor  # [len(rows)] absolute positions of the block's rows
    # Rows at consecutive positions split..num_keys-1: the tail is a square causal block, which a
    # causal kernel computes without a mask (prefix mode's suffix, the query run).
    contiguous: bool = False
    _masks: dict = field(default_factory=dict)

    @property
    def tail_mask(self) -> torch.Tensor:
        """[len(rows), num_keys - split] bool, True = may attend. Built on first use: a contiguous
        block never needs it, and for a whole prompt it would be T x T."""
        if "tail" not in self._masks:
            self._masks["tail"] = causal_mask(self.positions, self.num_keys, first_key=self.split)
        return self._masks["tail"]

    @property
    def mask(self) -> torch.Tensor:
        """The full [len(rows), num_keys] bool mask (the device path and tests). Built once per
        block, reused by every layer."""
        if "full" not in self._masks:
            self._masks["full"] = causal_mask(self.positions, self.num_keys)
        return self._masks["full"]

    def float_tail_mask(self, repeat: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive tail mask with each row repeated ``repeat`` times in a row ([S*repeat, n]), for
        grouped-query attention that keeps a KV head's query heads of one row adjacent. Built once
        per block, reused by every layer."""
        key = (repeat, dtype)
        if key not in self._masks:
            tail = self.tail_mask
            m = torch.zeros(tail.shape, dtype=dtype, device=tail.device).masked_fill_(
                ~tail, float("-inf")
            )
            self._masks[key] = m.repeat_interleave(repeat, dim=0)
        return self._masks[key]


def row_blocks(active: torch.Tensor, max_blocks: int = 4, min_rows: int = 64) -> list[RowBlock]:
    """Split sorted active rows into blocks that only attend keys up to their own last position.

    A single block over all keys would compute (and mask away) every score above the diagonal;
    blocking recovers part of what a causal kernel skips. More than a few blocks costs more in
    per-call overhead than it saves (measured on 2 cores). A contiguous run stays one block."""
    num_rows = active.numel()
    contiguous = int(active[-1]) - int(active[0]) == num_rows - 1
    num_blocks = 1 if contiguous else max(1, min(max_blocks, num_rows // min_rows))
    bounds = [round(i * num_rows / num_blocks) for i in range(num_blocks + 1)]
    blocks = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi <= lo:
            continue
        split, num_keys = int(active[lo]), int(active[hi - 1]) + 1
        blocks.append(
            RowBlock(
                slice(lo, hi),
                split,
                num_keys,
                active[lo:hi],
                contiguous=num_keys - split == hi - lo,
            )
        )
    return blocks


def grouped_queries(
    ops: TransformerOps,
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    halved: bool | None = None,
) -> torch.Tensor:
    """Pre-RoPE q [Hq, A, d] -> post-RoPE [Hkv, A * rep, d] with each row's ``rep`` query heads of a
    KV head adjacent (the layout ``attend_rows`` slices by row). cos/sin: [A, d] of the rows'
    positions. Rotating in row-major order and then permuting is faster than rotating into the
    permuted layout."""
    num_rows = q.shape[1]
    rows = apply_rope(q.transpose(0, 1), cos[:, None], sin[:, None], halved=halved)  # [A, Hq, d]
    grouped = rows.view(num_rows, ops.num_kv_heads, ops.group_size, ops.head_dim).permute(
        1, 0, 2, 3
    )
    return grouped.reshape(ops.num_kv_heads, num_rows * ops.group_size, ops.head_dim)


def _working_buffers(
    ops: TransformerOps, plan: PrefillPlan, cache: KVCache
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE K [L, Hkv, T, d] (stored rows in place, fresh rows written per layer) and V, which
    is the cache's own V rows: values need no rotation, so they are loaded and written there
    directly."""
    T = plan.num_tokens
    v_all = cache.v[:, :, :T]
    if plan.stored_v is not None and plan.stored_v.data_ptr() != v_all.data_ptr():
        if plan.wait_layer is not None:
            raise ValueError("a pipelined plan must load stored V into the cache's V rows")
        v_all.copy_(plan.stored_v)
    if plan.stored_k is not None:
        return plan.stored_k, v_all
    shape = (ops.num_layers, ops.num_kv_heads, T, ops.head_dim)
    return torch.empty(shape, dtype=ops.dtype, device=ops.device), v_all


def _project_rows(
    ops: TransformerOps,
    layer: int,
    h: torch.Tensor,
    active: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
) -> torch.Tensor:
    """Q/K/V of every active row: writes their pre-RoPE K and V into k_layer / v_layer [Hkv, T, d]
    and returns q [Hq, A, d] (pre-RoPE)."""
    q, k, v = (t[:, : active.numel()] for t in ops.qkv(layer, h))
    ops.write_rows(k_layer, k, active)
    ops.write_rows(v_layer, v, active)
    return q


def _first_layer_qkv(
    ops: TransformerOps,
    plan: PrefillPlan,
    h: torch.Tensor,
    active: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
) -> torch.Tensor:
    """Layer 0 of a plan with stored rows: returns q [Hq, A, d] of every active row, and writes
    fresh K/V [Hkv, T, d] for the unstored active rows only. Layer-0 K/V depends on the token alone
    (no attention precedes it), so a stored row's K/V there already is what a fresh projection
    gives."""
    num_rows = active.numel()
    fresh = (~plan.is_stored(active)).nonzero().flatten()  # local indices
    if fresh.numel() == num_rows:  # reuse / prefix: no stored row is computed, one matmul for all
        return _project_rows(ops, 0, h, active, k_layer, v_layer)
    (q,) = ops.qkv(0, h, "q")
    if fresh.numel():
        k, v = (t[:, : fresh.numel()] for t in ops.qkv(0, pad_rows(h[fresh]), "kv"))
        ops.write_rows(k_layer, k, active[fresh])
        ops.write_rows(v_layer, v, active[fresh])
    return q[:, :num_rows]
