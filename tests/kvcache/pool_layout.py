"""Tests build pool contents slot by slot, (num_slots, n_kv_heads, row_width), and compare against oracles in
that order; these convert to and from the pools' real layout, (num_blocks, n_kv_heads, block_size, row_width)
(kvcache/storage.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def as_pool(slot_rows, block_size: int):
    """(num_slots, n_kv, W) rows of consecutive slots (numpy or mlx) -> a row-contiguous pool of the same kind,
    (num_slots / block_size, n_kv, block_size, W)."""
    num_slots, n_kv, width = slot_rows.shape
    assert num_slots % block_size == 0, (num_slots, block_size)
    pool = slot_rows.reshape(num_slots // block_size, block_size, n_kv, width).transpose(0, 2, 1, 3)
    return mx.contiguous(pool) if isinstance(pool, mx.array) else np.ascontiguousarray(pool)


def as_slot_rows(pool):
    """A pool (num_blocks, n_kv, block_size, W) (numpy or mlx) -> its rows slot by slot (num_slots, n_kv, W)."""
    num_blocks, n_kv, block_size, width = pool.shape
    return pool.transpose(0, 2, 1, 3).reshape(num_blocks * block_size, n_kv, width)
