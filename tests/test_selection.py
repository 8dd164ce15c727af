"""Token selection as pure functions: checked against direct, unvectorised computations."""

from __future__ import annotations

import torch

from kvblend.blend.selection import query_attention, select_top_tokens


def _reference_query_attention(q, keys, positions, scaling):
    """One query head and one query row at a time: softmax over the keys it may see."""
    num_heads, num_rows = q.shape[0], q.shape[1]
    group = num_heads // keys.shape[0]
    total = torch.zeros(keys.shape[1], dtype=torch.float64)
    for head in range(num_heads):
        for row in range(num_rows):
            visible = int(positions[row]) + 1
            k = keys[head // group, :visible].double()
            probs = torch.softmax(k @ q[head, row].double() * scaling, dim=0)
            total[:visible] += probs
    return total


def test_query_attention_matches_a_direct_computation_with_grouped_heads():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 3, 8, generator=gen)  # 6 query heads over 2 key heads
    keys = torch.randn(2, 12, 8, generator=gen)
    positions = torch.tensor([7, 9, 10])  # key 11 follows every query row
    got = query_attention(q, keys, positions, 0.35)
    assert got.dtype == torch.float32 and got.shape == (12,)
    torch.testing.assert_close(got.double(), _reference_query_attention(q, keys, positions, 0.35), atol=1e-5, rtol=0)
    assert got[11] == 0  # exact causal: no query row sees a later key
    assert abs(float(got.sum()) - 6 * 3) < 1e-4  # each head's row distributes probability 1


def test_select_top_tokens_returns_the_largest_in_index_order():
    scores = torch.tensor([0.1, 5.0, 0.3, 4.0, 2.0])
    assert select_top_tokens(scores, 2).tolist() == [1, 3]
    assert select_top_tokens(scores, 0).tolist() == []
    assert select_top_tokens(scores, 9).tolist() == [0, 1, 2, 3, 4]
