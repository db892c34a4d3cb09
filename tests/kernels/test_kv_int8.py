"""int8 (q8) KV pools: kv_write quantizes as it writes, paged decode / prefill read the int8 rows directly.
Everything is checked against a numpy emulation: quantization in float32 (bit for bit), attention over
the dequantized values in float64 (skipped when the kernels are not built)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext
from kvcache import quantized
from kvcache.attention import AttentionMetadata, paged_attention
from kvcache.storage import PagedKVCache
from tests.kvcache.test_attention import dense_attention
from tests.kvcache.pool_layout import as_slot_rows

needs_kernels = pytest.mark.skipif(not ext.has_paged_prefill(), reason="kernels not built: python -m kernels.build")


def quantize_np(x: np.ndarray, group: int) -> np.ndarray:
    """x (..., hd) -> (..., hd + 2 * hd / group) int8 q8 rows, the arithmetic of kv_write.cpp in numpy."""
    hd = x.shape[-1]
    g = x.astype(np.float32).reshape(*x.shape[:-1], hd // group, group)  # (..., n_groups, group)
    d16 = (np.abs(g).max(-1, keepdims=True) / np.float32(127)).astype(np.float16)  # (..., n_groups, 1)
    d = d16.astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.round(np.clip(g * inv, -127, 127)).astype(np.int8)
    scale_bytes = np.ascontiguousarray(d16.reshape(*x.shape[:-1], -1)).view(np.int8)  # (..., 2 * n_groups)
    return np.concatenate([q.reshape(*x.shape[:-1], hd), scale_bytes], axis=-1)


def dequantize_np(rows: np.ndarray, hd: int) -> np.ndarray:
    """(..., row) int8 q8 rows -> (..., hd) float64."""
    groups = (rows.shape[-1] - hd) // 2
    q = rows[..., :hd].astype(np.float64).reshape(*rows.shape[:-1], groups, hd // groups)
    d = np.ascontiguousarray(rows[..., hd:]).view(np.float16).astype(np.float64)  # (..., groups)
    return (q * d[..., None]).reshape(*rows.shape[:-1], hd)


def kv_like(rng, shape) -> np.ndarray:
    """Random K/V rows (..., hd) float32 with an outlier channel, as real keys have, and a zero row."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 3] *= 12.0
    x.reshape(-1, shape[-1])[0] = 0.0
    return x


def scattered_tables(rng, contexts, block_size):
    need = [-(-ctx // block_size) for ctx in contexts]
    order = rng.permutation(sum(need) + 3)
    tables, used = [], 0
    for n in need:
        tables.append([int(b) for b in order[used : used + n]])
        used += n
    return tables, len(order)


def slots_of(table, start, end, block_size):
    pos = np.arange(start, end)
    return (np.asarray(table)[pos // block_size] * block_size + pos % block_size).astype(np.int32)


@needs_kernels
@pytest.mark.parametrize("head_dim,group", [(64, 32), (64, 64), (128, 32), (24, 24), (8, 8)])
def test_kv_write_quantizes_bit_for_bit_as_the_emulation_and_the_mlx_reference(head_dim, group):
    rng = np.random.default_rng(head_dim + group)
    x = kv_like(rng, (10, 3, head_dim)) * np.float32(3.0)
    width = head_dim + 2 * head_dim // group
    pool = mx.zeros((4, 3, 4, width), dtype=mx.int8)  # 4 blocks of 4 slots
    slots = mx.array(np.array([5, 0, 15, 2, 3, 4, 6, 7, 8, 9], dtype=np.int32))
    out = as_slot_rows(np.array(ext.load().kv_write(pool, mx.array(x), slots)))  # (16, 3, width)
    want = quantize_np(x, group)
    np.testing.assert_array_equal(out[np.array(slots)], want)
    assert not out[[1, 10, 11, 12, 13, 14]].any()  # untouched slots stay zero
    if group == quantized.group_size(head_dim):  # the MLX reference quantizer writes the same bytes
        np.testing.assert_array_equal(np.array(quantized.quantize(mx.array(x))), want)
        np.testing.assert_allclose(np.array(quantized.dequantize(mx.array(want), head_dim)), dequantize_np(want, head_dim),
                                   rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("n_heads,n_kv,head_dim,group", [(9, 3, 64, 32), (8, 2, 128, 32), (4, 4, 64, 64),
                                                         (16, 2, 24, 24), (6, 1, 128, 128)])
def test_decode_over_int8_pools_matches_float64_attention_of_the_dequantized_values(window, n_heads, n_kv,
                                                                                 head_dim, group, isa):
    """Contexts of 1, 16 (a full block), 17 (one past it) and 100 tokens, scattered blocks of 16; every
    instruction set this CPU runs (the `isa` fixture)."""
    rng = np.random.default_rng(n_heads * head_dim + (window or 0))
    bs, contexts = 16, [1, 16, 17, 100]
    tables, num_blocks = scattered_tables(rng, contexts, bs)
    width = head_dim + 2 * head_dim // group
    k_pool = mx.zeros((num_blocks, n_kv, bs, width), dtype=mx.int8)
    v_pool = mx.zeros_like(k_pool)
    write, stored = ext.load().kv_write, []
    for table, ctx in zip(tables, contexts):
        keys, values = kv_like(rng, (ctx, n_kv, head_dim)), kv_like(rng, (ctx, n_kv, head_dim))
        slots = mx.array(slots_of(table, 0, ctx, bs))
        k_pool, v_pool = write(k_pool, mx.array(keys), slots), write(v_pool, mx.array(values), slots)
        stored.append((dequantize_np(quantize_np(keys, group), head_dim), dequantize_np(quantize_np(values, group), head_dim)))
    q = rng.standard_normal((len(contexts), n_heads, head_dim)).astype(np.float32)
    padded = np.zeros((len(contexts), max(len(t) for t in tables)), dtype=np.int32)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = t
    scale = 1.0 / math.sqrt(head_dim)
    got = np.array(ext.paged_decode(mx.array(q), k_pool, v_pool, mx.array(padded),
                                    mx.array(np.array(contexts, dtype=np.int32)), scale=scale, block_size=bs,
                                    window=window or 0))
    for i, (ctx, (keys, values)) in enumerate(zip(contexts, stored)):
        want = dense_attention(q[i : i + 1].astype(np.float64), keys, values, np.array([ctx - 1]), window)
        np.testing.assert_allclose(got[i : i + 1], want, rtol=2e-5, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("window", [None, 50])
def test_a_prompt_in_chunks_over_cached_int8_kv_matches_float64_attention(n_heads, n_kv, head_dim, window, isa):
    """A 150-token prompt prefilled in chunks of 48 (key tiles of 32, blocks of 16 crossed mid-chunk):
    each chunk writes its K/V through PagedKVCache.write (the kernel quantizes), then attends over
    everything cached so far with the paged prefill kernel."""
    rng = np.random.default_rng(head_dim + n_heads)
    bs, total, chunk = 16, 150, 48
    tables, num_blocks = scattered_tables(rng, [total], bs)
    cache = PagedKVCache(1, num_blocks, bs, n_kv, head_dim, dtype=mx.int8)
    keys, values = kv_like(rng, (total, n_kv, head_dim)), kv_like(rng, (total, n_kv, head_dim))
    q = rng.standard_normal((total, n_heads, head_dim)).astype(np.float32)
    group = quantized.group_size(head_dim)
    k64, v64 = dequantize_np(quantize_np(keys, group), head_dim), dequantize_np(quantize_np(values, group), head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    for start in range(0, total, chunk):
        end = min(total, start + chunk)
        slots = mx.array(slots_of(tables[0], start, end, bs))
        k_pool, v_pool = cache.write(0, mx.array(keys[start:end]), mx.array(values[start:end]), slots)
        got = ext.paged_prefill(mx.array(q[start:end]), k_pool, v_pool, mx.array(np.asarray(tables[0], np.int32)),
                                first_position=start, scale=scale, block_size=bs, window=window or 0)
        want = dense_attention(q[start:end].astype(np.float64), k64[:end], v64[:end], np.arange(start, end), window)
        np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=2e-5)


@needs_kernels
def test_the_reference_backend_writes_the_same_bytes_and_attends_alike():
    """Pools written through MLX's quantize + scatter (reference) hold the kernel's bytes; the reference
    attention (dequantize the gathered rows, sdpa) agrees with the kernels on a mixed decode + chunk step."""
    rng = np.random.default_rng(3)
    bs, n_heads, n_kv, hd = 16, 6, 2, 64
    contexts, query_lens = [40, 70], [1, 30]
    tables, num_blocks = scattered_tables(rng, contexts, bs)
    caches = {}
    for backend in ("kernel", "reference"):
        cache = PagedKVCache(1, num_blocks, bs, n_kv, hd, dtype=mx.int8)
        if backend == "reference":
            cache._kv_write = None  # the plain-MLX write, as the reference backend (or a GPU) runs it
        for table, ctx in zip(tables, contexts):
            slots = mx.array(slots_of(table, 0, ctx, bs))
            cache.write(0, mx.array(kv_like(np.random.default_rng(ctx), (ctx, n_kv, hd))),
                        mx.array(kv_like(np.random.default_rng(ctx + 1), (ctx, n_kv, hd))), slots)
        caches[backend] = cache
    for a, b in zip(caches["kernel"].layer(0), caches["reference"].layer(0)):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    q = mx.array(rng.standard_normal((sum(query_lens), n_heads, hd)).astype(np.float32))
    outs = {}
    for backend in ("kernel", "reference"):
        md = AttentionMetadata.build(query_lens, contexts, tables, bs, backend=backend)
        outs[backend] = np.array(paged_attention(q, *caches[backend].layer(0), md, 0.125))
    np.testing.assert_allclose(outs["kernel"], outs["reference"], rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("width", [64, 65, 67, 70])
def test_a_pool_row_that_cannot_hold_q8_rows_is_refused(width):
    pool = mx.zeros((1, 2, 16, width), dtype=mx.int8)
    with pytest.raises(ValueError, match="int8"):
        ext.paged_decode(mx.ones((1, 2, 64)), pool, pool, mx.zeros((1, 1), dtype=mx.int32),
                         mx.array([1], dtype=mx.int32), scale=1.0, block_size=16, window=0)
    with pytest.raises(ValueError, match="int8"):
        ext.paged_prefill(mx.ones((2, 2, 64)), pool, pool, mx.zeros((1,), dtype=mx.int32), first_position=0,
                          scale=1.0, block_size=16, window=0)
    with pytest.raises(ValueError, match="q8"):
        ext.load().kv_write(pool, mx.ones((1, 2, 64)), mx.zeros((1,), dtype=mx.int32))


def test_row_width_counts_the_scales():
    assert quantized.row_width(64) == 68 and quantized.row_width(128) == 136 and quantized.row_width(24) == 26
    with pytest.raises(ValueError, match="multiple of 8"):
        quantized.row_width(20)
    assert PagedKVCache.bytes_per_block(30, 16, 3, 64, mx.int8) == 2 * 30 * 16 * 3 * 68
