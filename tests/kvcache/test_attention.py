"""Paged attention (reference path) against dense attention computed directly from the same data."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kernels.backend import attention_backend
from kvcache.attention import AttentionMetadata, paged_attention
from kvcache.storage import PagedKVCache


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setenv("METRALE_ATTENTION", "reference")


def dense_attention(q, keys, values, positions, window):
    """q (Q, H, D) at `positions`; keys/values (ctx, KV, D) for positions 0..ctx-1 -> (Q, H, D), numpy."""
    n_heads, n_kv = q.shape[1], keys.shape[1]
    k = np.repeat(keys, n_heads // n_kv, axis=1)  # (ctx, H, D)
    v = np.repeat(values, n_heads // n_kv, axis=1)  # (ctx, H, D)
    scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[2])  # (H, Q, ctx)
    k_pos = np.arange(keys.shape[0])[None, :]  # (1, ctx)
    allowed = k_pos <= positions[:, None]  # (Q, ctx)
    if window is not None:
        allowed &= k_pos > positions[:, None] - window
    scores = np.where(allowed[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)  # (Q, H, D)


def make_step(rng, query_lens, context_lens, *, block_size=4, num_blocks=None, n_heads=6, n_kv=2, head_dim=16):
    """Random contexts written into a pool through random, scattered block tables."""
    need = [-(-ctx // block_size) for ctx in context_lens]
    num_blocks = num_blocks or sum(need) + 7
    order = rng.permutation(num_blocks)  # scattered, non-contiguous, never shared
    tables, used = [], 0
    for n in need:
        tables.append([int(b) for b in order[used : used + n]])
        used += n
    cache = PagedKVCache(1, num_blocks, block_size, n_kv, head_dim)
    contexts = []
    for table, ctx in zip(tables, context_lens):
        keys = rng.standard_normal((ctx, n_kv, head_dim)).astype(np.float32)  # (ctx, KV, D)
        values = rng.standard_normal((ctx, n_kv, head_dim)).astype(np.float32)  # (ctx, KV, D)
        pos = np.arange(ctx)
        slots = np.asarray(table)[pos // block_size] * block_size + pos % block_size  # (ctx,)
        cache.write(0, mx.array(keys), mx.array(values), mx.array(slots.astype(np.int32)))
        contexts.append((keys, values))
    queries = rng.standard_normal((sum(query_lens), n_heads, head_dim)).astype(np.float32)  # (T, H, D)
    md = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    return cache, contexts, queries, md, tables


def check(query_lens, context_lens, window=None, seed=0, **kw):
    rng = np.random.default_rng(seed)
    cache, contexts, queries, md, _ = make_step(rng, query_lens, context_lens, **kw)
    k_pool, v_pool = cache.layer(0)
    scale = 1.0 / math.sqrt(queries.shape[2])
    out = np.array(paged_attention(mx.array(queries), k_pool, v_pool, md, scale, sliding_window=window))
    start = 0
    for qlen, ctx, (keys, values) in zip(query_lens, context_lens, contexts):
        positions = np.arange(ctx - qlen, ctx)
        expected = dense_attention(queries[start : start + qlen], keys, values, positions, window)
        np.testing.assert_allclose(out[start : start + qlen], expected, rtol=1e-4, atol=1e-5)
        start += qlen
    return out


def test_backend_is_reference_under_env():
    assert attention_backend() == "reference"


def test_decode_batch_with_different_context_lengths():
    check([1, 1, 1, 1], [1, 5, 17, 40])


def test_context_spanning_many_scattered_blocks():
    check([1, 3], [203, 150], block_size=4, num_blocks=200)


def test_prefill_from_scratch_is_causal():
    check([12], [12])


def test_prefill_chunk_after_cached_prefix():
    check([5], [21])


def test_mixed_batch_decodes_interleaved_with_chunks():
    check([1, 5, 1, 1, 9, 1], [41, 21, 8, 1, 9, 30])


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (6, 2), (8, 1), (9, 3)])
def test_gqa_head_ratios(n_heads, n_kv):
    check([1, 4, 1], [13, 10, 3], n_heads=n_heads, n_kv=n_kv)


@pytest.mark.parametrize("window", [1, 3, 8, 64])
def test_sliding_window(window):
    check([1, 6, 1, 7], [30, 25, 4, 7], window=window)


def test_slot_mapping_and_positions():
    block_size = 4
    tables = [[7, 2, 5], [3], [9, 0]]
    md = AttentionMetadata.build([5, 1, 2], [10, 3, 6], tables, block_size)
    positions = [5, 6, 7, 8, 9, 2, 4, 5]
    owner = [0] * 5 + [1] + [2] * 2
    expected = [tables[s][p // block_size] * block_size + p % block_size for s, p in zip(owner, positions)]
    assert md.positions.tolist() == positions
    assert md.slot_mapping.tolist() == expected
    assert md.query_starts == (0, 5, 6)
    assert md.num_tokens == 8 and md.num_decode == 1
    assert md.decode_context_lens.tolist() == [3]


def test_metadata_is_reused_by_layers_and_windows():
    rng = np.random.default_rng(3)
    cache, _, queries, md, _ = make_step(rng, [1, 4, 1], [9, 6, 20])
    k_pool, v_pool = cache.layer(0)
    q = mx.array(queries)
    first = paged_attention(q, k_pool, v_pool, md, 0.25)
    cached = md.num_cached
    again = paged_attention(q, k_pool, v_pool, md, 0.25)
    assert md.num_cached == cached  # no new gather indices on a second layer
    np.testing.assert_array_equal(np.array(first), np.array(again))
    paged_attention(q, k_pool, v_pool, md, 0.25, sliding_window=4)
    assert md.num_cached > cached


def test_half_precision_pool():
    rng = np.random.default_rng(4)
    cache = PagedKVCache(1, 8, 4, 2, 8, dtype=mx.float16)
    md = AttentionMetadata.build([1, 3], [5, 3], [[3, 1], [6]], 4)
    keys = mx.array(rng.standard_normal((8, 2, 8)).astype(np.float32))  # (ctx total, KV, D)
    k_pool, v_pool = cache.write(0, keys, keys, mx.arange(32, dtype=mx.int32)[:8])
    out = paged_attention(mx.array(rng.standard_normal((4, 4, 8)), dtype=mx.float16), k_pool, v_pool, md, 0.3)
    assert out.dtype == mx.float16 and out.shape == (4, 4, 8)
    assert bool(mx.all(mx.isfinite(out)))


@pytest.mark.parametrize(
    "args,match",
    [
        (([0], [3], [[0]], 4), "query_len"),
        (([4], [3], [[0]], 4), "query_len"),
        (([1], [9], [[0, 1]], 4), "covers fewer"),
        (([1, 1], [3], [[0]], 4), "one query_len"),
        (([1], [3], [[0]], 0), "block_size"),
    ],
)
def test_build_rejects_inconsistent_input(args, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build(*args)


def test_paged_attention_rejects_bad_shapes():
    cache = PagedKVCache(1, 4, 4, 2, 8)
    k_pool, v_pool = cache.layer(0)
    md = AttentionMetadata.build([1], [2], [[1]], 4)
    with pytest.raises(ValueError, match="T=1"):
        paged_attention(mx.zeros((2, 4, 8)), k_pool, v_pool, md, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(mx.zeros((1, 3, 8)), k_pool, v_pool, md, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(mx.zeros((1, 4, 8)), k_pool, v_pool, md, 1.0, sliding_window=0)
