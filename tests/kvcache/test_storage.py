"""PagedKVCache: sizing, writes and reads through slot mappings, and a footprint that never grows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels.backend import attention_backend
from kvcache.storage import PagedKVCache, pool_rows
from tests.kernels.test_kv_write_rounding import node_kinds
from tests.kvcache.pool_layout import as_slot_rows


def test_shapes_and_bytes():
    cache = PagedKVCache(num_layers=3, num_blocks=5, block_size=4, n_kv_heads=2, head_dim=8)
    k_pool, v_pool = cache.layer(2)
    assert k_pool.shape == v_pool.shape == (5, 2, 4, 8)  # (blocks, kv heads, block size, head_dim)
    assert cache.num_slots == 20
    assert cache.bytes == 3 * 2 * 20 * 2 * 8 * 4
    assert cache.bytes == 5 * PagedKVCache.bytes_per_block(3, 4, 2, 8)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_from_budget_fits_the_most_blocks(dtype):
    per_block = PagedKVCache.bytes_per_block(2, 16, 3, 64, dtype)
    cache = PagedKVCache.from_budget(10 * per_block + per_block - 1, 2, 16, 3, 64, dtype)
    assert cache.num_blocks == 10
    assert cache.bytes == 10 * per_block <= 11 * per_block - 1
    assert cache.layer(0)[0].dtype == dtype


def test_sixteen_bit_pools_hold_twice_the_blocks_of_float32():
    budget = 3 << 20
    wide = PagedKVCache.from_budget(budget, 2, 16, 3, 64, mx.float32)
    for dtype in (mx.float16, mx.bfloat16):
        half = PagedKVCache.from_budget(budget, 2, 16, 3, 64, dtype)
        assert half.num_blocks == 2 * wide.num_blocks and half.bytes == wide.bytes <= budget


def test_from_budget_shares_the_budget_with_other_pools():
    own = PagedKVCache.bytes_per_block(2, 16, 3, 64)
    shared = 3 * own  # e.g. a draft model's pools, which hold as many blocks
    cache = PagedKVCache.from_budget(10 * (own + shared) + own, 2, 16, 3, 64, shared_bytes_per_block=shared)
    assert cache.num_blocks == 10
    with pytest.raises(ValueError, match=f"holds no block.*{shared} bytes in pools sharing the budget"):
        PagedKVCache.from_budget(own + shared - 1, 2, 16, 3, 64, shared_bytes_per_block=shared)


def test_from_budget_too_small_says_why():
    with pytest.raises(ValueError, match="holds no block"):
        PagedKVCache.from_budget(1000, 30, 16, 3, 64)


@pytest.mark.parametrize("field", ["num_layers", "num_blocks", "block_size", "n_kv_heads", "head_dim"])
def test_rejects_non_positive_sizes(field):
    sizes = dict(num_layers=1, num_blocks=1, block_size=1, n_kv_heads=1, head_dim=1)
    sizes[field] = 0
    with pytest.raises(ValueError, match=field):
        PagedKVCache(**sizes)


def test_write_then_read_through_slot_mapping():
    rng = np.random.default_rng(0)
    cache = PagedKVCache(num_layers=2, num_blocks=8, block_size=4, n_kv_heads=2, head_dim=4)
    slots = np.array([31, 0, 17, 5, 6], dtype=np.int32)  # (T,)
    keys = rng.standard_normal((5, 2, 4)).astype(np.float32)  # (T, KV, D)
    values = rng.standard_normal((5, 2, 4)).astype(np.float32)  # (T, KV, D)
    k_pool, v_pool = cache.write(1, mx.array(keys), mx.array(values), mx.array(slots))
    np.testing.assert_array_equal(np.array(k_pool)[slots // 4, :, slots % 4], keys)  # slot s: block s / 4, row s % 4
    np.testing.assert_array_equal(np.array(v_pool)[slots // 4, :, slots % 4], values)
    reversed_slots = slots[::-1].copy()
    rows = mx.array(pool_rows(reversed_slots, 2, 4).astype(np.int32))  # (T, KV) rows of the flat pool
    got_k, got_v = (pool.reshape(-1, 4)[rows] for pool in cache.layer(1))
    np.testing.assert_array_equal(np.array(got_k), keys[::-1])
    np.testing.assert_array_equal(np.array(got_v), values[::-1])
    untouched = np.setdiff1d(np.arange(32), slots)
    assert not np.array(as_slot_rows(k_pool))[untouched].any()
    assert not np.array(cache.layer(0)[0]).any()  # other layers untouched


def test_write_casts_to_pool_dtype():
    cache = PagedKVCache(1, 2, 4, 1, 2, dtype=mx.float16)
    k_pool, _ = cache.write(0, mx.ones((1, 1, 2)), mx.ones((1, 1, 2)), mx.array([3], dtype=mx.int32))
    assert k_pool.dtype == mx.float16 and k_pool[0, :, 3].tolist() == [[1.0, 1.0]]


def test_write_rejects_bad_shapes():
    cache = PagedKVCache(1, 2, 4, 2, 4)
    kv = mx.zeros((3, 2, 4))
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.write(0, kv, kv, mx.zeros((2,), dtype=mx.int32))
    with pytest.raises(ValueError, match=r"\(T, 2, 4\)"):
        cache.write(0, mx.zeros((3, 1, 4)), mx.zeros((3, 1, 4)), mx.zeros((3,), dtype=mx.int32))
    with pytest.raises(IndexError):
        cache.write(1, kv, kv, mx.zeros((3,), dtype=mx.int32))


def test_footprint_fixed_across_many_writes():
    """Writes reuse the pool buffers: no growth, and no transient pool copy (peak stays small)."""
    cache = PagedKVCache(num_layers=4, num_blocks=256, block_size=16, n_kv_heads=3, head_dim=64)  # 12 MiB
    keys = mx.ones((32, 3, 64))  # (T, KV, D)
    mx.eval(keys)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    for step in range(50):
        slots = mx.array(np.arange(32, dtype=np.int32) * 97 + step)  # (T,)
        for layer in range(cache.num_layers):
            k_pool, v_pool = cache.write(layer, keys, keys, slots)
            _ = (k_pool.sum() + v_pool.sum()).item()  # a consumer, as attention would be
    one_pool = cache.bytes // (2 * cache.num_layers)
    assert mx.get_active_memory() - base < one_pool // 4
    assert mx.get_peak_memory() - base < one_pool // 4, "a write copied a pool"
    assert cache.bytes == 4 * 2 * 4096 * 3 * 64 * 4


def test_copy_blocks_copies_every_layer_and_leaves_the_rest():
    cache = PagedKVCache(num_layers=2, num_blocks=6, block_size=4, n_kv_heads=2, head_dim=3)
    for layer in range(2):
        keys = mx.arange(24 * 6, dtype=mx.float32).reshape(24, 2, 3) + 1000 * layer
        cache.write(layer, keys, -keys, mx.arange(24, dtype=mx.int32))
    before = [np.array(as_slot_rows(pool)) for layer in range(2) for pool in cache.layer(layer)]
    cache.copy_blocks([(1, 4), (4, 2)])  # sources are read before any destination is written
    for i, pool in enumerate(pool for layer in range(2) for pool in cache.layer(layer)):
        got, old = np.array(as_slot_rows(pool)), before[i]
        np.testing.assert_array_equal(got[16:20], old[4:8])
        np.testing.assert_array_equal(got[8:12], old[16:20])
        untouched = [r for r in range(24) if not (8 <= r < 12 or 16 <= r < 20)]
        np.testing.assert_array_equal(got[untouched], old[untouched])
    with pytest.raises(ValueError, match="out of range"):
        cache.copy_blocks([(0, 6)])


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_kernel_and_indexed_writes_agree_and_keep_held_pools_intact(monkeypatch, backend):
    """The CPU kernel's write (one node per pool) and MLX's scatter into the pool's rows give the same pools.
    Both rebind the cache's pool, so a holder of the old one keeps the old values (the write copied the pool
    for it)."""
    if backend == "kernel" and attention_backend() != "kernel":
        pytest.skip("kernels not built: python -m kernels.build")
    monkeypatch.setenv("METRALE_ATTENTION", backend)
    cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=4, n_kv_heads=2, head_dim=8)
    rng = np.random.default_rng(0)
    held = cache.layer(0)[0]  # an old pool someone still reads
    keys, values = (mx.array(rng.standard_normal((3, 2, 8)).astype(np.float32)) for _ in range(2))
    slots = mx.array([5, 0, 15], dtype=mx.int32)
    k_pool, v_pool = cache.write(0, keys, values, slots)
    want_k, want_v = np.zeros((16, 2, 8), np.float32), np.zeros((16, 2, 8), np.float32)
    want_k[[5, 0, 15]], want_v[[5, 0, 15]] = np.array(keys), np.array(values)
    np.testing.assert_array_equal(np.array(as_slot_rows(k_pool)), want_k)
    np.testing.assert_array_equal(np.array(as_slot_rows(v_pool)), want_v)
    np.testing.assert_array_equal(np.array(as_slot_rows(held)), 0.0)


def test_each_kv_heads_rows_of_a_block_are_contiguous():
    """The layout the kernels assume (kv_row_offset in kernels/csrc/kernel_table.h): slot s of kv head g sits at
    row ((s // block_size) * n_kv + g) * block_size + s % block_size of the flat pool, whichever backend wrote it."""
    for backend in ("reference", "kernel"):
        cache = PagedKVCache(num_layers=1, num_blocks=3, block_size=4, n_kv_heads=2, head_dim=8)
        if backend == "reference":
            cache._kv_write = None
        elif cache._kv_write is None:
            continue
        slots = np.array([0, 5, 11, 6], dtype=np.int32)
        keys = np.arange(4 * 2 * 8, dtype=np.float32).reshape(4, 2, 8)
        k_pool, _ = cache.write(0, mx.array(keys), mx.array(keys), mx.array(slots))
        flat = np.array(k_pool).reshape(-1, 8)  # (3 * 2 * 4, 8)
        for t, slot in enumerate(slots):
            for g in range(2):
                np.testing.assert_array_equal(flat[((slot // 4) * 2 + g) * 4 + slot % 4], keys[t, g])
        np.testing.assert_array_equal(flat[pool_rows(slots, 2, 4)], keys)  # the gathers' indices agree


def test_the_mlx_write_builds_the_steps_rows_once_for_every_layer():
    """Without the kernels every layer scatters K and V into its pools' rows: the step's (T, n_kv) row indices
    come from its one slot_mapping once, and each pool costs one Scatter (a reshape on either side)."""
    cache = PagedKVCache(num_layers=3, num_blocks=4, block_size=4, n_kv_heads=2, head_dim=8)
    cache._kv_write = None  # the plain-MLX write, as the reference backend (or a GPU) runs it
    slot_mapping, keys = mx.array([1, 5, 14], dtype=mx.int32), mx.ones((3, 2, 8))
    pools = [pool for layer in range(3) for pool in cache.write(layer, keys, 2 * keys, slot_mapping)]
    kinds = node_kinds(*pools)
    assert kinds.count("Scatter") == 6 and kinds.count("Reshape") <= 6 * 3, kinds
    rows = [np.array(as_slot_rows(pool))[[1, 5, 14]] for pool in pools]
    for layer in range(3):
        np.testing.assert_array_equal(rows[2 * layer], 1.0)
        np.testing.assert_array_equal(rows[2 * layer + 1], 2.0)
