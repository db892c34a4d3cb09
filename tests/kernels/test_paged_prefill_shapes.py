"""The paged prefill kernel's tiling edges, on every instruction set this build runs: GQA groups of 1 to 8
query heads per kv head, head_dim 64 and 128, chunks that start mid-block, 1-token chunks, contexts that
cross many scattered blocks and several key tiles, float16 / bfloat16 / int8 pools. Each chunk is checked
against float64 dense attention over the values the pool holds (skipped when the kernels are not built)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext
from kvcache import quantized
from kvcache.storage import PagedKVCache
from tests.kernels.test_kv_int8 import dequantize_np, quantize_np, scattered_tables, slots_of
from tests.kvcache.test_attention import dense_attention

needs_prefill = pytest.mark.skipif(not ext.has_paged_prefill(), reason="kernels not built: python -m kernels.build")

BLOCK = 16
ROOT = Path(__file__).resolve().parents[2]


def stored(x: np.ndarray, dtype) -> np.ndarray:
    """x (..., hd) float32 as a `dtype` pool holds it, widened to float64 (int8: q8 rows, dequantized)."""
    if dtype == mx.int8:
        return dequantize_np(quantize_np(x, quantized.group_size(x.shape[-1])), x.shape[-1])
    return np.array(mx.array(x).astype(dtype).astype(mx.float32)).astype(np.float64)


def prefill_in_chunks(chunks, *, n_heads, n_kv, head_dim, dtype, window=None, seed=0):
    """A prompt of sum(chunks) tokens prefilled chunk by chunk (each writes its K/V, then attends over all
    cached so far) through a scattered block table; asserts every chunk's output against float64."""
    rng = np.random.default_rng(seed)
    total = sum(chunks)
    tables, num_blocks = scattered_tables(rng, [total], BLOCK)
    cache = PagedKVCache(1, num_blocks, BLOCK, n_kv, head_dim, dtype=dtype)
    keys = rng.standard_normal((total, n_kv, head_dim)).astype(np.float32)  # (total, KV, hd)
    values = rng.standard_normal((total, n_kv, head_dim)).astype(np.float32)  # (total, KV, hd)
    q = (2.0 * rng.standard_normal((total, n_heads, head_dim))).astype(np.float32)  # (total, H, hd): peaked rows
    k64, v64 = stored(keys, dtype), stored(values, dtype)
    table = mx.array(np.asarray(tables[0], np.int32))
    start = 0
    for n in chunks:
        end = start + n
        slots = mx.array(slots_of(tables[0], start, end, BLOCK))
        k_pool, v_pool = cache.write(0, mx.array(keys[start:end]), mx.array(values[start:end]), slots)
        got = ext.paged_prefill(mx.array(q[start:end]), k_pool, v_pool, table, first_position=start,
                                scale=1.0 / math.sqrt(head_dim), block_size=BLOCK, window=window or 0)
        want = dense_attention(q[start:end].astype(np.float64), k64[:end], v64[:end], np.arange(start, end), window)
        np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=2e-5, err_msg=f"chunk {start}..{end}")
        start = end


@needs_prefill
@pytest.mark.parametrize("n_heads,n_kv", [(8, 8), (8, 4), (12, 4), (16, 4), (16, 2), (32, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_groups_and_head_dims_over_chunks_that_start_mid_block(n_heads, n_kv, head_dim, isa):
    """Chunks of 37, 90 and 5 tokens: each later chunk starts mid-block and mid key tile."""
    prefill_in_chunks([37, 90, 5], n_heads=n_heads, n_kv=n_kv, head_dim=head_dim, dtype=mx.float16,
                      seed=n_heads + head_dim)


@needs_prefill
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.int8, mx.float32])
@pytest.mark.parametrize("window", [None, 40])
def test_one_token_chunks_after_a_long_prefix(dtype, window, isa):
    """A 300-token prefix (19 blocks, five key tiles) then three 1-token chunks: one query row per task."""
    prefill_in_chunks([300, 1, 1, 1], n_heads=8, n_kv=2, head_dim=64, dtype=dtype, window=window, seed=7)


@needs_prefill
@pytest.mark.parametrize("dtype", [mx.float16, mx.int8])
def test_a_chunk_whose_context_crosses_many_blocks_and_tiles(dtype, isa):
    """A 160-query chunk at context 1,200 (75 scattered blocks, 19 key tiles, 10 query tiles), the 1B GQA
    ratio (4 query heads per kv head)."""
    prefill_in_chunks([1040, 160], n_heads=8, n_kv=2, head_dim=64, dtype=dtype, seed=11)


@needs_prefill
@pytest.mark.parametrize("dtype", [mx.float16, mx.int8])
@pytest.mark.parametrize("n_heads,n_kv,window", [(9, 3, None), (4, 1, None), (9, 3, 1500)])
def test_short_chunks_at_a_long_context_split_their_keys(dtype, n_heads, n_kv, window, isa):
    """Chunks of 9, 32 and 2 tokens after a 2,000-token prefix. The 9 and 32 are one query tile per kv head, fewer
    tasks than two per thread and enough work for the threads (paged_prefill.cpp: kMinParallelWork), so with 2+
    kernel threads each task's keys are split into parts (key-tile boundaries, 512+ keys each) and merged
    (test_a_split_range_really_splits checks that the split runs); the 2-token chunk stays on one thread. The
    default model's 3 kv heads, a single kv head (more parts) and a window that starts mid-range."""
    prefill_in_chunks([2000, 9, 32, 2], n_heads=n_heads, n_kv=n_kv, head_dim=64, dtype=dtype, window=window,
                      seed=n_heads + n_kv)


SPLIT_PROBE = """
import sys
import kernels.runtime  # noqa: F401
import mlx.core as mx
import numpy as np
from kernels import ext
ext.load()
rng = np.random.default_rng(0)
k, v = (mx.array(rng.standard_normal((200, 3, 16, 64)).astype(np.float32)).astype(mx.float16) for _ in range(2))
q = mx.array(rng.standard_normal((9, 9, 64)).astype(np.float32))
out = ext.paged_prefill(q, k, v, mx.array(np.arange(128, dtype=np.int32)), first_position=2039, scale=0.125,
                        block_size=16, window=0)
np.save(sys.argv[1], np.array(out))
"""


@needs_prefill
def test_a_split_range_really_splits(tmp_path):
    """The same 9-query chunk at context 2,048 on 1 and on 2 kernel threads (METRALE_ATTENTION_THREADS, fixed per
    process): both agree within float32 rounding, and they are not bit-identical, which only the split's merge
    (its own order of sums) makes them: the split ran."""
    outs = []
    for threads in (1, 2):
        path = tmp_path / f"out{threads}.npy"
        env = {**os.environ, "METRALE_ATTENTION_THREADS": str(threads)}
        subprocess.run([sys.executable, "-c", SPLIT_PROBE, str(path)], check=True, env=env, cwd=ROOT)
        outs.append(np.load(path))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    assert not np.array_equal(outs[0], outs[1])


@needs_prefill
def test_a_bad_block_in_one_part_of_a_split_range_makes_its_rows_nan():
    """12 queries at context 2,048 with one kv head (one task, split into parts over 2+ threads): block 100 of
    the table is outside the pool, so every row is NaN, as when one task reads the whole range; a good table
    gives finite rows."""
    bs, n_kv = 16, 1
    pool = mx.ones((200, n_kv, bs, 64)).astype(mx.float16)
    good = np.arange(128, dtype=np.int32)
    bad = good.copy()
    bad[100] = 9999
    for table, finite in ((good, True), (bad, False)):
        out = np.array(ext.paged_prefill(mx.ones((12, 3, 64)), pool, pool, mx.array(table), first_position=2036,
                                         scale=0.125, block_size=bs, window=0))
        assert np.isfinite(out).all() if finite else np.isnan(out).all()
