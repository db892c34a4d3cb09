"""The C++ paged prefill kernel (kernels/csrc/paged_prefill.cpp) against dense attention and the gathered
matmul path it replaced (skipped when the kernels are not built)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext
from kvcache import attention
from kvcache.attention import AttentionMetadata
from tests.kvcache.test_attention import dense_attention, make_step

needs_prefill = pytest.mark.skipif(not ext.has_paged_prefill(), reason="kernels not built: python -m kernels.build")


def widened(a, dtype):
    """a (numpy float32) as the pool stores it: rounded to `dtype`, back in float32."""
    return np.array(mx.array(a).astype(dtype).astype(mx.float32))


@needs_prefill
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 100])
@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(9, 3, 64), (4, 4, 24), (16, 2, 8), (8, 2, 64)])
def test_chunks_over_many_key_tiles_match_dense(dtype, window, n_heads, n_kv, head_dim):
    """A chunk of 37 queries after a 263-token prefix (ten key tiles of 32, a partial query tile), and
    a first chunk of 21: every row equals dense attention over the values the pool holds."""
    rng = np.random.default_rng(5)
    cache, contexts, queries, md, tables = make_step(rng, [37, 21], [300, 21], block_size=16, n_heads=n_heads,
                                                     n_kv=n_kv, head_dim=head_dim)
    k_pool, v_pool = (p.astype(dtype) for p in cache.layer(0))
    scale = 1.0 / math.sqrt(head_dim)
    start = 0
    for chunk, (keys, values) in zip(md.chunks, contexts):
        q = queries[start : start + chunk.query_len]  # (q_len, H, hd)
        table = mx.array(np.asarray(tables[chunk.index], dtype=np.int32))
        got = ext.paged_prefill(mx.array(q), k_pool, v_pool, table, first_position=chunk.first_position,
                                scale=scale, block_size=16, window=window or 0)
        assert got.dtype == mx.float32 and got.shape == q.shape
        positions = np.arange(chunk.first_position, chunk.context_len)
        want = dense_attention(q, widened(keys, dtype), widened(values, dtype), positions, window)
        np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=2e-5)
        start += chunk.query_len


@needs_prefill
def test_the_gathered_path_agrees_with_the_kernel():
    """The matmul + fused softmax path (builds without paged_prefill) gives the kernel's output."""
    rng = np.random.default_rng(6)
    cache, _, queries, md, _ = make_step(rng, [40], [130], block_size=8, n_heads=6, n_kv=2, head_dim=32)
    k_pool, v_pool = (p.astype(mx.float16) for p in cache.layer(0))
    q = mx.array(queries)
    fast = attention._chunk_attention(q, k_pool, v_pool, md, md.chunks[0], 0.2, 50, True)
    gathered = attention._chunk_gathered(q, k_pool, v_pool, md, md.chunks[0], 0.2, 50, True)
    np.testing.assert_allclose(np.array(fast), np.array(gathered), rtol=1e-4, atol=1e-5)


@needs_prefill
def test_a_block_outside_the_pool_gives_nan_rows_not_a_crash():
    pool = mx.ones((4, 1, 16, 8))  # 4 blocks of 16
    out = ext.paged_prefill(mx.ones((64, 1, 8)), pool, pool, mx.array([0, 1, 9, 2], dtype=mx.int32),
                            first_position=0, scale=1.0, block_size=16, window=0)
    out = np.array(out)  # (64, 1, 8): query tile 0 (32 queries, positions 0..31) reads blocks 0 and 1 only,
    assert np.isfinite(out[:32]).all() and np.isnan(out[32:]).all()  # tile 1 reaches block 9


@needs_prefill
@pytest.mark.parametrize(
    "q_shape,pool_shape,table_len,first,match",
    [
        ((4, 4, 8), (4, 3, 4, 8), 2, 0, "multiple"),
        ((4, 4, 8), (4, 2, 4, 16), 2, 0, "head_dim"),
        ((4, 4, 12), (4, 2, 4, 12), 2, 0, "multiple of 8"),
        ((4, 4, 8), (4, 2, 4, 8), 1, 2, "does not cover"),
        ((4, 4, 8), (4, 2, 4, 8), 2, -1, "first_position"),
        ((4, 4, 8), (16, 2, 8), 2, 0, "num_blocks, n_kv_heads, block_size"),
        ((4, 4, 8), (2, 2, 8, 8), 2, 0, "is not the pools' 8"),
    ],
)
def test_kernel_validates_its_input(q_shape, pool_shape, table_len, first, match):
    pool = mx.zeros(pool_shape)
    with pytest.raises(ValueError, match=match):
        ext.paged_prefill(mx.zeros(q_shape), pool, pool, mx.zeros((table_len,), dtype=mx.int32),
                          first_position=first, scale=1.0, block_size=4, window=0)


@needs_prefill
def test_long_context_memory_does_not_grow_with_a_score_matrix():
    """A 512-query chunk at context 4096 allocates about its output, not a (heads, 512, 4096) score tensor."""
    n_heads, n_kv, hd, ctx, q_len, bs = 8, 2, 64, 4096, 512, 16
    pool = mx.random.normal((ctx // bs, n_kv, bs, hd)).astype(mx.float16)
    queries = mx.random.normal((q_len, n_heads, hd))
    md = AttentionMetadata.build([q_len], [ctx], [list(range(ctx // bs))], bs, backend="kernel")
    mx.eval(pool, queries)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = attention.paged_attention(queries, pool, pool, md, 0.125)
    mx.eval(out)
    scores_bytes = n_heads * q_len * ctx * 4  # 64 MiB
    assert mx.get_peak_memory() - base < scores_bytes // 8, mx.get_peak_memory() - base
