"""BufferPool: recycled flat buffers for KV caches and prefill workspaces (no model needed)."""

from __future__ import annotations

import pytest
import torch

from kvblend.blend.buffers import SIZE_STEP, BufferPool, typed_view


def test_a_given_back_buffer_is_handed_out_again_best_fit_first():
    pool = BufferPool(max_free_bytes=1 << 30)
    small, large = pool.take(SIZE_STEP), pool.take(3 * SIZE_STEP)
    assert small.numel() == SIZE_STEP and large.numel() == 3 * SIZE_STEP
    pool.give(large)
    pool.give(small)
    pool.give(small)  # twice: still one entry
    assert pool.free_bytes == 4 * SIZE_STEP
    again = pool.take(SIZE_STEP // 2)
    assert again is small and pool.reused == 1  # the smallest that fits, not the first
    assert pool.take(2 * SIZE_STEP) is large and pool.reused == 2
    fresh = pool.take(SIZE_STEP)  # nothing free fits: a new one, rounded up to the size step
    assert fresh is not small and fresh is not large and fresh.numel() == SIZE_STEP


def test_pool_keeps_at_most_its_budget_dropping_the_smallest():
    pool = BufferPool(max_free_bytes=3 * SIZE_STEP)
    bufs = [pool.take(SIZE_STEP), pool.take(SIZE_STEP), pool.take(2 * SIZE_STEP)]
    for b in bufs:
        pool.give(b)
    assert pool.free_bytes == 3 * SIZE_STEP  # one of the small ones went
    assert pool.take(2 * SIZE_STEP) is bufs[2]
    off = BufferPool(max_free_bytes=0)
    buf = off.take(10)
    off.give(buf)
    assert off.free_bytes == 0 and off.take(10) is not buf
    with pytest.raises(ValueError, match="max_free_bytes"):
        BufferPool(-1)


def test_typed_view_shapes_the_start_of_a_buffer():
    buf = BufferPool().take(1000)
    v = typed_view(buf, (2, 3, 4), torch.float32)
    assert v.shape == (2, 3, 4) and v.dtype == torch.float32 and v.data_ptr() == buf.data_ptr()
    v.fill_(1.5)
    assert typed_view(buf, (24,), torch.float32).sum().item() == 36.0
    with pytest.raises(ValueError, match="too small"):
        typed_view(buf[:1000], (1000,), torch.float32)
