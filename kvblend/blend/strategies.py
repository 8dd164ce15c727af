"""Token selections as strategies: which chunk rows ``blend`` keeps recomputing.

``run_prefill`` asks the plan's strategy at each check layer which rows stay computed
(``check_qkv``, or ``check_attention`` after the layer's attention when ``after_attention``); the
engine runs ``prepare`` once before the layer loop (lookahead's reuse pass lives there). A new
selection is a subclass registered with ``@register_selection("name")`` plus a ``Selection`` member
(kvblend/policy.py) for requests to name it.

Dominated variants stay registered as experimental: they still run (benches compare against them)
but the docs and ``--help`` do not recommend them. Measured on SmolLM2-135M, 100 MuSiQue prompts
(CHANGELOG.md "Token selection, measured"): ``query`` at 0.15 gave 92% agreement / KL 0.101 at 4.11x
against ``lookahead``'s 97% / 0.036 at 4.01x. Deviation kinds ``k`` and ``kv`` project every row's Q
and K at the check layer for no better ranking (``kv`` KL 0.187 against ``v``'s 0.183; ``k`` alone
never measured better), so they are experimental too; ``attn`` is not (faster and closer on SmolLM2,
worse on Qwen2.5-Coder: an option per model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import ClassVar

import torch

from kvblend.blend.blender import (
    ROW_ALIGN,
    KVCache,
    PrefillPlan,
    QueryAttentionRecorder,
    create_attention,
    pad_rows,
    run_prefill,
)
from kvblend.blend.rope import apply_rope
from kvblend.blend.selection import attention_deviation, select_top_tokens, token_deviation
from kvblend.config import DEVIATION_KINDS
from kvblend.models.transformer import TransformerOps
from kvblend.policy import PrefillPolicy

# Deviation kinds kept for comparison only (see the module docstring for the numbers).
EXPERIMENTAL_DEVIATIONS = ("k", "kv")


class SelectionStrategy:
    """Base strategy: no ``prepare`` step, and at a check layer the paper's KV deviation of
    ``deviation`` kind (what a strategy without its own check-layer ranking falls back to)."""

    name: ClassVar[str] = ""
    experimental: ClassVar[bool] = False

    def __init__(self, deviation: str = "v"):
        if deviation not in DEVIATION_KINDS:
            raise ValueError(f"deviation must be one of {DEVIATION_KINDS}, got {deviation!r}")
        self.deviation = deviation

    @classmethod
    def from_options(cls, *, deviation: str = "v", depth: int | None = None) -> SelectionStrategy:
        """The strategy ``create_selection`` builds; only lookahead takes a layer count."""
        if depth:
            raise ValueError(f"only lookahead takes a layer count, not {cls.name!r}")
        return cls(deviation)

    @property
    def after_attention(self) -> bool:
        """Whether a check narrows the rows after the layer's attention (``check_attention``)
        rather than at its projections (``check_qkv``)."""
        return False

    def prepare(self, ops: TransformerOps, plan: PrefillPlan, cache: KVCache) -> PrefillPlan:
        """Run once before the layer loop; may return a changed plan. Default: unchanged."""
        return plan

    def check_qkv(
        self,
        ops: TransformerOps,
        plan: PrefillPlan,
        layer: int,
        h: torch.Tensor,
        active: torch.Tensor,
        k_layer: torch.Tensor,
        v_layer: torch.Tensor,
        num_keep: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A check layer: writes fresh K/V of the active rows into k_layer / v_layer
        [Hkv, T, d] (pre-RoPE) and returns (q [Hq, K, d] of the rows kept from here on, their
        local indices into ``active`` [K], their hidden rows [K + pad, D])."""
        return _deviation_check_qkv(
            ops, self.deviation, plan, layer, h, active, k_layer, v_layer, num_keep
        )

    def check_attention(
        self,
        ops: TransformerOps,
        plan: PrefillPlan,
        layer: int,
        attention,
        q: torch.Tensor,
        active: torch.Tensor,
        k_layer: torch.Tensor,
        v_layer: torch.Tensor,
        k_cache: torch.Tensor,
        num_keep: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A check after the layer's attention (``after_attention``): (local indices of the rows
        kept [K], their attention [K + pad, Hq * d]). q [Hq, A, d] pre-RoPE."""
        raise NotImplementedError(f"selection {self.name!r} has no after-attention check")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(deviation={self.deviation!r})"


SELECTIONS: dict[str, type[SelectionStrategy]] = {}


def register_selection(name: str, *, experimental: bool = False) -> Callable[[type], type]:
    """Class decorator: make a strategy creatable by ``name``."""

    def register(cls: type[SelectionStrategy]) -> type[SelectionStrategy]:
        if name in SELECTIONS:
            raise ValueError(f"token selection {name!r} is already registered")
        cls.name, cls.experimental = name, experimental
        SELECTIONS[name] = cls
        return cls

    return register


def create_selection(
    selection: str | PrefillPolicy, *, deviation: str = "v", lookahead_layers: int | None = None
) -> SelectionStrategy:
    """The strategy a resolved policy (or a name, "lookahead:8" allowed) asks for. ``deviation``:
    BlendConfig.deviation; ``lookahead_layers`` overrides the name's depth."""
    if isinstance(selection, PrefillPolicy):
        # its label carries a depth for lookahead only (a resolved policy has one for every kind)
        selection = selection.selection_label or ""
    name, _, count = selection.partition(":")
    depth = int(count) if count.isdigit() else None
    if count and depth is None:
        raise ValueError(f"a selection's layer count must be a whole number, got {selection!r}")
    if name not in SELECTIONS:
        raise ValueError(
            f"unknown token selection {name!r}; expected one of {', '.join(sorted(SELECTIONS))}"
        )
    if lookahead_layers is not None:
        depth = lookahead_layers
    return SELECTIONS[name].from_options(deviation=deviation, depth=depth)


def experimental_selections() -> tuple[str, ...]:
    """Experimental names as requests and benches spell them, deviation kinds as "deviation k"."""
    names = tuple(name for name, cls in SELECTIONS.items() if cls.experimental)
    return names + tuple(f"deviation {kind}" for kind in EXPERIMENTAL_DEVIATIONS)


@register_selection("deviation")
class DeviationSelection(SelectionStrategy):
    """CacheBlend's: the rows whose fresh KV deviates most from the cached at the check layer
    (kinds v, k, kv), or with ``deviation`` "attn" whose attention output moves most once they see
    the other chunks (checked after the layer's attention, so layer 0 can be a check layer)."""

    @property
    def after_attention(self) -> bool:
        return self.deviation == "attn"

    def check_attention(
        self, ops, plan, layer, attention, q, active, k_layer, v_layer, k_cache, num_keep
    ):
        return _attention_check(
            ops, plan, layer, attention, q, active, k_layer, v_layer, k_cache, num_keep
        )


@register_selection("query", experimental=True)
class QuerySelection(SelectionStrategy):
    """The rows the query rows attend to most at the check layer (query-aware, as A3). A check
    with no query row among the active ones falls back to the KV deviation."""

    def check_qkv(self, ops, plan, layer, h, active, k_layer, v_layer, num_keep):
        is_stored = plan.is_stored(active)  # [A] bool
        if bool(is_stored.all()):
            return super().check_qkv(ops, plan, layer, h, active, k_layer, v_layer, num_keep)
        return _query_check_qkv(ops, layer, h, active, is_stored, k_layer, v_layer, num_keep)


@register_selection("lookahead")
class LookaheadSelection(DeviationSelection):
    """The rows the query attends to most summed over a reuse pass run first (``prepare``); the
    blend then recomputes them from layer 0 with no check layer. Layer-0 KV is context-free, so the
    dropped rows lose nothing by skipping layer 0, which offsets part of the pass's cost.
    ``depth`` > 0 stops the pass after that many layers (their attention alone ranks the rows).
    A plan run without ``prepare`` keeps its check layers, and they rank as ``deviation``'s."""

    def __init__(self, deviation: str = "v", depth: int = 0):
        super().__init__(deviation)
        self.depth = depth

    @classmethod
    def from_options(cls, *, deviation: str = "v", depth: int | None = None) -> SelectionStrategy:
        return cls(deviation, depth or 0)

    def prepare(self, ops: TransformerOps, plan: PrefillPlan, cache: KVCache) -> PrefillPlan:
        if not plan.check_layers:  # no chunk row to rank
            return plan
        active = plan.active_rows
        is_stored = plan.is_stored(active)
        # the last row is always computed: its logits are the first token
        always = torch.unique(torch.cat([active[~is_stored], active[-1:]]))
        candidates = active[is_stored & (active != active[-1])]
        num_keep = plan.check_keep[-1]
        if 0 < num_keep < candidates.numel():
            chosen = self._ranked(ops, plan, cache, always, candidates, num_keep)
        else:  # nothing to rank: recompute all candidates or none
            chosen = candidates[:num_keep]
        return replace(
            plan,
            active_rows=torch.unique(torch.cat([always, chosen])),
            check_layers=(),
            check_keep=(),
        )

    def _ranked(self, ops, plan, cache, always, candidates, num_keep) -> torch.Tensor:
        """The ``num_keep`` candidate rows [C] the query attends to most in a reuse pass (only
        ``always``, the unstored rows, computed over the stored KV)."""
        reuse = replace(
            plan,
            active_rows=always,
            check_layers=(),
            check_keep=(),
            record_query_attention=True,
            num_layers=self.depth or None,
        )
        received = run_prefill(ops, reuse, cache).query_attention  # [T]
        # plan rows stay on the CPU
        return candidates[select_top_tokens(received[candidates], num_keep).cpu()]

    def __repr__(self) -> str:
        return f"LookaheadSelection(deviation={self.deviation!r}, depth={self.depth})"


# ---- check-layer mechanics ---------------------------------------------------------------------


def _deviation_check_qkv(
    ops: TransformerOps,
    deviation: str,
    plan: PrefillPlan,
    layer: int,
    h: torch.Tensor,
    active: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    num_keep: int,
):
    """``SelectionStrategy.check_qkv`` by KV deviation. With the value deviation (the default) only
    V is projected for every row, Q and K only for the kept ones (~15%): dropped rows keep their
    stored K at this layer, as at every later one."""
    num_rows = active.numel()
    is_stored = plan.is_stored(active)  # [A] bool
    if deviation == "v":
        (v,) = ops.qkv(layer, h, "v")
        v = v[:, :num_rows]
        keep = _check_rows(deviation, active, is_stored, None, v, k_layer, v_layer, num_keep)
        ops.write_rows(v_layer, v, active)
        h = pad_rows(h[keep])
        q, k = (t[:, : keep.numel()] for t in ops.qkv(layer, h, "qk"))
        ops.write_rows(k_layer, k, active[keep])
        return q, keep, h
    q, k, v = (t[:, :num_rows] for t in ops.qkv(layer, h))
    keep = _check_rows(deviation, active, is_stored, k, v, k_layer, v_layer, num_keep)
    ops.write_rows(k_layer, k, active)
    ops.write_rows(v_layer, v, active)
    # rows gathered in q_proj's own [A, Hq, d] layout, so grouping them stays a view
    return q.transpose(0, 1)[keep].transpose(0, 1), keep, pad_rows(h[keep])


def _query_check_qkv(
    ops: TransformerOps,
    layer: int,
    h: torch.Tensor,
    active: torch.Tensor,
    is_stored: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    num_keep: int,
):
    """``check_qkv`` with query-aware selection: fresh K/V of every active row are written, then
    the query rows (the unstored active rows) attend over every key of this layer; the ``num_keep``
    stored rows they attend to most stay computed. Q is projected for the query rows, then for the
    kept ones."""
    T, num_rows = k_layer.shape[1], active.numel()
    k, v = (t[:, :num_rows] for t in ops.qkv(layer, h, "kv"))
    ops.write_rows(k_layer, k, active)
    ops.write_rows(v_layer, v, active)
    query = (~is_stored).nonzero().flatten()  # local indices of the query rows
    (q_query,) = ops.qkv(layer, pad_rows(h[query]), "q")
    recorder = QueryAttentionRecorder(ops, T)
    keys = apply_rope(k_layer, *recorder.cos_sin)  # [Hkv, T, d]: every row at its absolute position
    recorder.add(q_query[:, : query.numel()], keys, active[query])
    received = recorder.total  # [T]
    cand = is_stored.nonzero().flatten()
    keep = _kept_rows(is_stored, cand, received[active[cand]], num_keep)
    h = pad_rows(h[keep])
    (q,) = ops.qkv(layer, h, "q")
    return q[:, : keep.numel()], keep, h


def _attention_check(
    ops: TransformerOps,
    plan: PrefillPlan,
    layer: int,
    attention,
    q: torch.Tensor,
    active: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    k_cache: torch.Tensor,
    num_keep: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An "attn" check layer: (local indices of the rows kept [K], their attention
    [K + pad, Hq * d]).

    The rows are ranked by one query head of each KV group (``attention.head_subsets``: the native
    kernel attends any subset of heads): every row's attention over every key is the costly part of
    the check, and a third of SmolLM2's heads rank the rows (CHANGELOG.md: "Attention-output
    deviation, measured"). The kept rows then attend with every head. q [Hq, A, d] pre-RoPE."""
    check_q = q
    if attention.head_subsets:  # [Hkv, A, d], each row's heads dense, as the kernel reads
        check_q = q[:: ops.group_size].transpose(0, 1).contiguous().transpose(0, 1)
    check_attn = attention(layer, check_q, k_layer, v_layer, k_cache, active)  # [A, Hc * d]
    keep = _attention_check_rows(
        ops, plan, layer, check_q, check_attn, active, k_layer, v_layer, num_keep
    )
    if check_q is q:
        return keep, check_attn[keep]
    kept_q = q.transpose(0, 1)[keep].transpose(0, 1)  # gathered in q_proj's own [A, Hq, d] layout
    num_out_rows = -(-keep.numel() // ROW_ALIGN) * ROW_ALIGN  # as pad_rows pads the kept h rows
    return keep, attention(layer, kept_q, k_layer, v_layer, k_cache, active[keep], num_out_rows)


def _attention_check_rows(
    ops: TransformerOps,
    plan: PrefillPlan,
    layer: int,
    q: torch.Tensor,
    attn: torch.Tensor,
    active: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    num_keep: int,
) -> torch.Tensor:
    """Local indices (into ``active``) that stay computed after an "attn" check layer: unstored
    rows, and the ``num_keep`` stored rows whose attention output ``attn`` [A, Hq * d] (over every
    key) differs most from their attention over their own chunk and the prefix. q [Hq, A, d]
    pre-RoPE; k_layer, v_layer [Hkv, T, d] pre-RoPE K and V of this layer."""
    is_stored = plan.is_stored(active)  # [A] bool
    cand = is_stored.nonzero().flatten()  # local indices of stored rows
    if num_keep >= cand.numel():
        return torch.arange(active.numel(), device=active.device)
    q_cand = q.transpose(0, 1)[cand].transpose(0, 1)  # gathered in q_proj's own [A, Hq, d] layout
    local = _local_attention(ops, plan, layer, q_cand, active[cand], k_layer, v_layer)
    return _kept_rows(is_stored, cand, attention_deviation(attn[cand], local), num_keep)


def _local_attention(
    ops: TransformerOps,
    plan: PrefillPlan,
    layer: int,
    q: torch.Tensor,
    rows: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
) -> torch.Tensor:
    """Attention of stored chunk ``rows`` [C] (ascending; q [H, C, d] pre-RoPE, every query head
    or the check's subset) over the prompt's prefix and their own chunk only -> [C, H * d]. Each
    chunk goes right after the prefix, as it was cached, so its keys keep their distances to each
    other (RoPE sees nothing else). About a tenth of the full attention's work for ten chunks."""
    prefix = plan.prefix_len
    out = torch.empty(rows.numel(), q.shape[0] * ops.head_dim, dtype=q.dtype, device=q.device)
    bounds = torch.tensor([b for span in plan.chunk_spans for b in span], device=rows.device)
    cuts = torch.searchsorted(rows, bounds).tolist()  # [lo, hi) of each span's rows in ``rows``
    covered = 0
    for (start, end), lo, hi in zip(plan.chunk_spans, cuts[0::2], cuts[1::2]):
        if hi == lo:
            continue
        keys = torch.cat([k_layer[:, :prefix], k_layer[:, start:end]], dim=1)  # [Hkv, P + L, d]
        values = torch.cat([v_layer[:, :prefix], v_layer[:, start:end]], dim=1)
        attention = create_attention(ops, keys.shape[1])
        out[lo:hi] = attention(
            layer, q[:, lo:hi], keys, values, torch.empty_like(keys), rows[lo:hi] - start + prefix
        )
        covered += hi - lo
    if covered != rows.numel():
        raise ValueError(
            f"deviation 'attn' needs every candidate row in the plan's chunk_spans "
            f"({rows.numel() - covered} of {rows.numel()} are not)"
        )
    return out


def _check_rows(
    deviation: str,
    active: torch.Tensor,
    is_stored: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor,
    stored_k_layer: torch.Tensor,
    stored_v_layer: torch.Tensor,
    num_keep: int,
) -> torch.Tensor:
    """Local indices (into ``active``) that stay computed after this check layer.

    Unstored active rows (query, fresh segments) always stay; among stored active rows the
    ``num_keep`` with the largest fresh-vs-stored deviation stay. is_stored: [A] bool; k, v
    [Hkv, A, d] fresh; stored_*_layer [Hkv, T, d]."""
    cand = is_stored.nonzero().flatten()  # local indices of stored rows
    rows = active[cand]
    if k is None:  # the value deviation: keys are not compared
        dev = token_deviation(None, v[:, cand], None, stored_v_layer[:, rows], deviation)
    else:
        dev = token_deviation(
            k[:, cand], v[:, cand], stored_k_layer[:, rows], stored_v_layer[:, rows], deviation
        )
    return _kept_rows(is_stored, cand, dev, num_keep)


def _kept_rows(
    is_stored: torch.Tensor, cand: torch.Tensor, scores: torch.Tensor, num_keep: int
) -> torch.Tensor:
    """The rule every check shares: local indices (sorted) of the rows that stay computed, i.e.
    every unstored row and the ``num_keep`` candidates with the largest ``scores``. is_stored [A]
    bool; cand [C] its True indices; scores [C]."""
    chosen = cand[select_top_tokens(scores, num_keep)]
    return torch.cat([(~is_stored).nonzero().flatten(), chosen]).sort().values
