"""Token selection for CacheBlend, as pure functions over tensors.

At a check layer every candidate row has fresh K/V (computed in the real, mixed context) and cached
K/V (computed with its chunk alone). Ways to score which rows keep being recomputed (the rest reuse
their cached KV from here on):

    deviation  rows whose KV deviates most are the ones missing cross-chunk attention (CacheBlend);
               or, with ``attention_deviation``, rows whose attention output moves most once they
               see the other chunks (measurable at layer 0, before its MLP)
    query      rows the query attends to most at the check layer: their errors are the ones the
               answer reads (query-aware selection, as in A3, arXiv 2511.17560)
    lookahead  rows the query attends to most summed over every layer of a reuse pass run first
               (``LookaheadSelection.prepare`` runs that pass; ``query_attention`` scores each
               layer)

The strategies that apply these at check layers are in kvblend/blend/strategies.py.
"""

from __future__ import annotations

import math

import torch


def token_deviation(
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    cached_k: torch.Tensor,
    cached_v: torch.Tensor,
    kind: str = "v",
) -> torch.Tensor:
    """Squared L2 deviation per token, summed over heads and dims.

    fresh_*/cached_*: [kv_heads, N, d] (keys pre-RoPE, so positions do not enter) -> float32 [N].
    """

    def sq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.float() - b.float()).pow(2).sum(dim=(0, 2))

    if kind == "v":
        return sq(fresh_v, cached_v)
    if kind == "k":
        return sq(fresh_k, cached_k)
    if kind == "kv":
        return sq(fresh_k, cached_k) + sq(fresh_v, cached_v)
    raise ValueError(f"unknown deviation kind {kind!r}")


def attention_deviation(full_out: torch.Tensor, local_out: torch.Tensor) -> torch.Tensor:
    """Squared L2 between rows' attention output over every key and over their own chunk (and the
    prompt's prefix) only: how much the other chunks change what each row reads.

    full_out, local_out: [N, Hq * d] (one layer's attention output before o_proj) -> float32 [N]."""
    return (full_out.float() - local_out.float()).pow(2).sum(dim=-1)


def query_attention(
    query_q: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
    max_scores: int = 1 << 24,
) -> torch.Tensor:
    """Attention probability each key receives from the query rows, summed over heads and rows.

    query_q [Hq, Q, d] and keys [Hkv, T, d] post-RoPE (Hq a multiple of Hkv: grouped-query heads
    share a key head); query_positions [Q]: the rows' absolute positions, each sees keys at
    positions <= its own (exact causal). -> float32 [T]. Rows go in blocks of at most ``max_scores``
    fp32 scores.

    One batched matmul per block (every key head at once), and only the keys from the earliest row's
    position on are masked: the reuse pass of ``lookahead`` calls this every layer. For 32 query
    rows over 6,254 keys, per-head calls with a [Q, T] mask took a median of 5.6 ms against 3.7 ms
    (2-core Xeon, bf16).
    """
    num_kv_heads, num_keys, head_dim = keys.shape
    num_heads, num_rows = query_q.shape[0], query_q.shape[1]
    group = num_heads // num_kv_heads
    keys_t = keys.float().transpose(1, 2)  # [Hkv, d, T]
    total = torch.zeros(num_keys, dtype=torch.float32, device=keys.device)
    block = max(1, max_scores // (num_heads * num_keys))
    for start in range(0, num_rows, block):
        positions = query_positions[start : start + block]
        first = int(positions.min())  # keys before it precede every row of the block
        hidden = ~causal_mask(positions, num_keys, first_key=first)  # [B, T - first]
        q = query_q[:, start : start + block].float().mul(scaling)  # [Hq, B, d]
        rows = q.shape[1]
        scores = torch.bmm(
            q.reshape(num_kv_heads, group * rows, head_dim), keys_t
        )  # [Hkv, group * B, T]
        scores = scores.view(num_kv_heads, group, rows, num_keys)
        scores[..., first:].masked_fill_(hidden, float("-inf"))
        total += torch.softmax(scores, dim=-1).view(-1, num_keys).sum(0)
    return total


def num_to_keep(ratio: float, num_candidates: int) -> int:
    """How many of ``num_candidates`` chunk tokens a ratio keeps (ceil, so r > 0 keeps at least
    one)."""
    return min(num_candidates, int(math.ceil(ratio * num_candidates - 1e-9)))


def select_top_tokens(deviation: torch.Tensor, num_keep: int) -> torch.Tensor:
    """Indices (into ``deviation``) of the ``num_keep`` largest deviations, in ascending index
    order."""
    if num_keep >= deviation.numel():
        return torch.arange(deviation.numel(), device=deviation.device)
    if num_keep <= 0:
        return torch.empty(0, dtype=torch.long, device=deviation.device)
    return torch.topk(deviation, num_keep, sorted=False).indices.sort().values


def causal_mask(query_positions: torch.Tensor, num_keys: int, first_key: int = 0) -> torch.Tensor:
    """Exact causal mask by absolute position: a query at position p sees keys at positions <= p.

    query_positions [S] -> bool [S, num_keys - first_key] over keys first_key..num_keys-1. (Not the
    bottom-right approximation, which lets a selected early token see later keys.)"""
    key_positions = torch.arange(first_key, num_keys, device=query_positions.device)
    return key_positions[None, :] <= query_positions[:, None]
