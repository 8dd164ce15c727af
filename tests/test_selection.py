"""Token selection as pure functions: checked against direct, unvectorised computations."""

from __future__ import annotations

import pytest
import torch

from kvblend.blend.selection import attention_deviation, query_attention, select_top_tokens
from kvblend.config import BlendConfig, parse_selection


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
    torch.testing.assert_close(
        got.double(), _reference_query_attention(q, keys, positions, 0.35), atol=1e-5, rtol=0
    )
    assert got[11] == 0  # exact causal: no query row sees a later key
    assert abs(float(got.sum()) - 6 * 3) < 1e-4  # each head's row distributes probability 1


def test_select_top_tokens_returns_the_largest_in_index_order():
    scores = torch.tensor([0.1, 5.0, 0.3, 4.0, 2.0])
    assert select_top_tokens(scores, 2).tolist() == [1, 3]
    assert select_top_tokens(scores, 0).tolist() == []
    assert select_top_tokens(scores, 9).tolist() == [0, 1, 2, 3, 4]


def test_query_attention_in_row_blocks_matches_one_block():
    """Rows split into blocks (a bound on score memory) sum to the same totals, with unsorted,
    non-contiguous positions."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 7, 8, generator=gen)
    keys = torch.randn(2, 20, 8, generator=gen)
    positions = torch.tensor([19, 3, 11, 12, 0, 17, 8])
    whole = query_attention(q, keys, positions, 0.3)
    blocked = query_attention(q, keys, positions, 0.3, max_scores=4 * 20 * 2)  # two rows a block
    torch.testing.assert_close(blocked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        whole.double(), _reference_query_attention(q, keys, positions, 0.3), atol=1e-5, rtol=0
    )


def test_parse_selection_takes_a_layer_count_for_lookahead_only():
    assert parse_selection("deviation") == ("deviation", None)
    assert parse_selection("lookahead") == ("lookahead", None)
    assert parse_selection("lookahead:8") == ("lookahead", 8)
    for bad in ("deviation:2", "lookahead:", "lookahead:-1", "lookahead:two", "best"):
        with pytest.raises(ValueError):
            parse_selection(bad)
    with pytest.raises(ValueError, match="lookahead_layers must be an integer >= 0"):
        BlendConfig(lookahead_layers=-1)


def test_attention_deviation_is_the_squared_distance_per_row():
    full = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    local = torch.tensor([[1.0, 0.0, 1.0], [0.5, 0.0, 0.0]], dtype=torch.bfloat16)
    got = attention_deviation(full, local)
    assert got.dtype == torch.float32 and got.tolist() == [8.0, 0.25]


def test_check_layers_default_to_the_deviations_first_useful_layer():
    assert BlendConfig().check_layers == (1,)  # KV deviation: layer-0 KV is context-free
    assert BlendConfig(deviation="attn").check_layers == (
        0,
    )  # attention output: deviates from layer 0 on
    assert BlendConfig(
        deviation="attn", check_layers=(0, 4), check_ratios=(0.3, 0.15)
    ).check_layers == (0, 4)
    with pytest.raises(ValueError, match="check_layers must be >= 1 with deviation 'v'"):
        BlendConfig(deviation="v", check_layers=(0,))
    with pytest.raises(ValueError, match="deviation must be one of"):
        BlendConfig(deviation="q")
