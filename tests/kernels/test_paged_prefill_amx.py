"""The AMX-BF16 prefill attention (kernels/csrc/prefill_amx.cpp, the avx512_amx set's staged kernel) against
float64 dense attention over the values the pool holds, and against the avx512 set's float32 kernel, on the
tile edges: head_dim 8..256 (K tiles of 32 d, V^T tiles of 16), GQA 1..8, chunks of 16..600 queries (row
tiles of 16) at first_position 0 and mid-block, key blocks of 64 crossed at odd lengths, block sizes 1..32,
windows, float16 / bfloat16 pools. Chunks under 16 queries, float32 pools and int8 (q8) pools take the
avx512 kernel (bit-identical). Skipped where this CPU or Linux does not run the avx512_amx set."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext
from kvcache import quantized
from tests.kernels.isa_helpers import evaluated_on as on
from tests.kernels.test_kv_int8 import dequantize_np, quantize_np
from tests.kvcache.test_attention import dense_attention
from tests.kvcache.pool_layout import as_pool

needs_amx = pytest.mark.skipif(ext.load() is None or "avx512_amx" not in ext.supported_isas(),
                               reason="the avx512_amx kernel set does not run here (no AMX, or Linux refused the tile state)")

RTOL, ATOL = 1e-4, 2e-5  # the existing prefill tests' bound against float64 (test_paged_prefill*.py)


class Case:
    """One chunk of q_len queries at first_position over a scattered paged pool of `dtype`."""

    def __init__(self, rng, *, n_heads, n_kv, head_dim, q_len, first, block_size, dtype):
        self.first, self.block_size, self.head_dim = first, block_size, head_dim
        context = first + q_len
        blocks = (context + block_size - 1) // block_size
        order = rng.permutation(blocks + 3)[:blocks]  # scattered block ids, 3 spare blocks in the pool
        keys = rng.standard_normal((context, n_kv, head_dim)).astype(np.float32)  # (context, KV, hd)
        values = rng.standard_normal((context, n_kv, head_dim)).astype(np.float32)  # (context, KV, hd)
        self.q = (2.0 * rng.standard_normal((q_len, n_heads, head_dim))).astype(np.float32)  # (q_len, H, hd)
        slots = order[np.arange(context) // block_size] * block_size + np.arange(context) % block_size
        self.k_pool, self.k64 = self._pool(keys, slots, (blocks + 3) * block_size, block_size, dtype)
        self.v_pool, self.v64 = self._pool(values, slots, (blocks + 3) * block_size, block_size, dtype)
        self.table = mx.array(order.astype(np.int32))

    @staticmethod
    def _pool(x, slots, num_slots, block_size, dtype):
        """x (context, KV, hd) float32 written at `slots` of a `dtype` pool (num_blocks, KV, block_size, row);
        also x as the pool holds it, float64."""
        if dtype == mx.int8:
            rows = quantize_np(x, quantized.group_size(x.shape[-1]))  # (context, KV, row bytes) int8
            pool = np.zeros((num_slots, *rows.shape[1:]), np.int8)
            pool[slots] = rows
            return mx.array(as_pool(pool, block_size)), dequantize_np(rows, x.shape[-1])
        pool = np.zeros((num_slots, *x.shape[1:]), np.float32)
        pool[slots] = x
        stored = mx.array(x).astype(dtype).astype(mx.float32)
        return mx.array(as_pool(pool, block_size)).astype(dtype), np.array(stored).astype(np.float64)

    def run(self, isa: str, window: int = 0) -> np.ndarray:
        return on(isa, lambda: np.array(ext.paged_prefill(
            mx.array(self.q), self.k_pool, self.v_pool, self.table, first_position=self.first,
            scale=1.0 / math.sqrt(self.head_dim), block_size=self.block_size, window=window)))

    def want(self, window: int = 0) -> np.ndarray:
        positions = np.arange(self.first, self.first + self.q.shape[0])
        return dense_attention(self.q.astype(np.float64), self.k64, self.v64, positions, window or None)


def check(case: Case, window: int = 0) -> None:
    amx, avx512, want = case.run("avx512_amx", window), case.run("avx512", window), case.want(window)
    np.testing.assert_allclose(amx, want, rtol=RTOL, atol=ATOL, err_msg="avx512_amx against float64")
    np.testing.assert_allclose(amx, avx512, rtol=RTOL, atol=2 * ATOL, err_msg="avx512_amx against avx512")


@needs_amx
@pytest.mark.parametrize("head_dim", [8, 24, 40, 64, 96, 128, 256])
def test_head_dims_over_the_k_and_v_tile_widths(head_dim):
    """head_dim not a multiple of 32 (K tiles) or 16 (V^T tiles) is zero-padded in the tiles."""
    rng = np.random.default_rng(head_dim)
    check(Case(rng, n_heads=4, n_kv=2, head_dim=head_dim, q_len=37, first=90, block_size=16, dtype=mx.float16))


@needs_amx
@pytest.mark.parametrize("rep", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_groups_share_the_staged_tiles(rep, head_dim):
    """rep query heads per kv head as rows of one task: 16-row tiles cut across queries at every rep."""
    rng = np.random.default_rng(rep * head_dim)
    check(Case(rng, n_heads=2 * rep, n_kv=2, head_dim=head_dim, q_len=45, first=131, block_size=16,
               dtype=mx.float16))


@needs_amx
@pytest.mark.parametrize("q_len,first", [(16, 0), (17, 0), (63, 0), (64, 1), (65, 63), (129, 300), (600, 0),
                                         (600, 777)])
def test_chunk_lengths_and_starts_across_row_tiles_and_key_blocks(q_len, first):
    """Chunks of 16..600 queries at position 0 and mid-block: partial row tiles, the diagonal inside and
    across 64-key blocks, several query tiles per kv head (paged_prefill.cpp's tasks)."""
    rng = np.random.default_rng(q_len + first)
    check(Case(rng, n_heads=8, n_kv=2, head_dim=64, q_len=q_len, first=first, block_size=16, dtype=mx.float16))


@needs_amx
@pytest.mark.parametrize("block_size", [1, 3, 8, 32])
@pytest.mark.parametrize("window", [0, 1, 40, 100])
def test_block_sizes_and_windows(block_size, window):
    """Windows that start inside a key block, mask whole blocks, or keep one key (window 1)."""
    rng = np.random.default_rng(block_size * 100 + window)
    case = Case(rng, n_heads=6, n_kv=2, head_dim=64, q_len=70, first=150, block_size=block_size, dtype=mx.float16)
    check(case, window)


@needs_amx
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("window", [0, 33])
def test_pool_dtypes(dtype, window):
    """float16 (split into hi + lo exactly) and bfloat16 (hi only)."""
    rng = np.random.default_rng(7 if window else 8)
    check(Case(rng, n_heads=8, n_kv=2, head_dim=128, q_len=100, first=211, block_size=16, dtype=dtype), window)


@needs_amx
@pytest.mark.parametrize("dtype", [mx.int8, mx.float32])
@pytest.mark.parametrize("window", [0, 33])
def test_int8_and_float32_pools_take_the_avx512_kernel(dtype, window):
    """q8 values need 19 bits and float32 ones 24; hi + lo bf16 keep ~17 (test_kv_int8's bound failed, and
    float32 pools' logits moved 10-20x further from float64 in test_architectures): avx512's kernel runs."""
    rng = np.random.default_rng(9)
    case = Case(rng, n_heads=8, n_kv=2, head_dim=128, q_len=100, first=211, block_size=16, dtype=dtype)
    assert np.array_equal(case.run("avx512_amx", window), case.run("avx512", window))


@needs_amx
@pytest.mark.parametrize("q_len", [1, 5, 15])
def test_chunks_under_16_queries_take_the_avx512_kernel(q_len):
    """Staging costs more than it saves for a few queries: those chunks run avx512's kernel, bit for bit."""
    rng = np.random.default_rng(q_len)
    case = Case(rng, n_heads=8, n_kv=2, head_dim=64, q_len=q_len, first=300, block_size=16, dtype=mx.float16)
    assert np.array_equal(case.run("avx512_amx"), case.run("avx512"))


@needs_amx
def test_chunks_of_16_queries_take_the_tile_kernel():
    """From 16 queries the bf16 tile products run: not bit-identical to the float32 kernel, within the bound."""
    rng = np.random.default_rng(16)
    case = Case(rng, n_heads=8, n_kv=2, head_dim=64, q_len=16, first=300, block_size=16, dtype=mx.float16)
    amx = case.run("avx512_amx")
    assert not np.array_equal(amx, case.run("avx512"))
    np.testing.assert_allclose(amx, case.want(), rtol=RTOL, atol=ATOL)


@needs_amx
def test_only_rows_that_see_a_bad_block_id_are_nan():
    """Keys behind a block id outside the pool are staged as zeros, so exactly the rows that would read
    them are NaN (the avx512 kernel marks its whole 32-query tile)."""
    pool = mx.ones((64, 1, 8), dtype=mx.float16)  # 4 blocks of 16
    out = on("avx512_amx", lambda: np.array(ext.paged_prefill(
        mx.ones((64, 1, 8)), pool, pool, mx.array([0, 1, 9, 2], dtype=mx.int32), first_position=0, scale=1.0,
        block_size=16, window=0)))  # (64, 1, 8): positions 32.. see block 2 (id 9)
    assert np.isfinite(out[:32]).all() and np.isnan(out[32:]).all()
    windowed = on("avx512_amx", lambda: np.array(ext.paged_prefill(
        mx.ones((64, 1, 8)), pool, pool, mx.array([0, 9, 1, 2], dtype=mx.int32), first_position=0, scale=1.0,
        block_size=16, window=8)))  # block 1 (positions 16..31) is bad: rows 16..38 see one of its keys
    assert np.isfinite(windowed[:16]).all() and np.isnan(windowed[16:39]).all() and np.isfinite(windowed[39:]).all()
