"""The C++ paged decode kernel against the reference attention (skipped when it is not built)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext as _ext
from kernels.backend import attention_backend
from kvcache.attention import AttentionMetadata, paged_attention
from kvcache.storage import PagedKVCache

from tests.kvcache.test_attention import check, make_step

kernel = _ext.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="kernel not built: python -m kernels.build")


def both_backends(monkeypatch, query_lens, context_lens, window=None, dtype=mx.float32, **kw):
    """(reference, kernel) outputs of paged_attention on the same random step."""
    rng = np.random.default_rng(7)
    cache, _, queries, md, _ = make_step(rng, query_lens, context_lens, **kw)
    k_pool, v_pool = (p.astype(dtype) for p in cache.layer(0))
    q = mx.array(queries).astype(dtype)
    scale = 1.0 / math.sqrt(queries.shape[2])
    outs = []
    for backend in ("reference", "auto"):
        monkeypatch.setenv("METRALE_ATTENTION", backend)
        outs.append(np.array(paged_attention(q, k_pool, v_pool, md, scale, sliding_window=window).astype(mx.float32)))
    return outs


@needs_kernel
def test_kernel_is_the_default_on_cpu(monkeypatch):
    monkeypatch.delenv("METRALE_ATTENTION", raising=False)
    assert attention_backend() == "kernel"
    monkeypatch.setenv("METRALE_ATTENTION", "reference")
    assert attention_backend() == "reference"


@needs_kernel
@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (6, 2), (9, 3), (8, 1), (16, 1), (24, 2)])
def test_decode_matches_reference_gqa(monkeypatch, n_heads, n_kv):
    ref, fast = both_backends(monkeypatch, [1] * 5, [1, 7, 16, 33, 250], n_heads=n_heads, n_kv=n_kv)
    np.testing.assert_allclose(fast, ref, rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_decode_matches_reference_sliding_window(monkeypatch, window):
    ref, fast = both_backends(monkeypatch, [1] * 4, [3, 16, 17, 90], window=window)
    np.testing.assert_allclose(fast, ref, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_mixed_batch_with_kernel_matches_dense(monkeypatch):
    monkeypatch.setenv("METRALE_ATTENTION", "auto")
    check([1, 5, 1, 1, 9, 1], [41, 21, 8, 1, 9, 300], block_size=8)  # the same dense oracle as the reference
    check([1, 1, 4], [60, 3, 12], window=7)


@needs_kernel
@pytest.mark.parametrize("window", [None, 1, 6, 40])
@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (9, 3), (16, 1)])
def test_prefill_chunks_match_reference(monkeypatch, window, n_heads, n_kv):
    """Chunks from scratch and after a cached prefix, through the kernel softmax path."""
    ref, fast = both_backends(monkeypatch, [13, 1, 7, 33], [13, 20, 50, 33], window=window,
                              n_heads=n_heads, n_kv=n_kv)
    np.testing.assert_allclose(fast, ref, rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("offset,window", [(0, 0), (5, 0), (5, 3), (0, 1), (-2, 0)])
def test_causal_softmax_matches_numpy(offset, window):
    rng = np.random.default_rng(1)
    scores = rng.standard_normal((3, 6, 11)).astype(np.float32) * 4  # (heads, q_len, L)
    q = np.arange(6)[:, None]
    k = np.arange(11)[None, :]
    keep = k <= q + offset
    if window:
        keep &= k > q + offset - window
    masked = np.where(keep, scores, -np.inf)
    with np.errstate(invalid="ignore"):
        expected = np.exp(masked - masked.max(-1, keepdims=True))
        expected /= expected.sum(-1, keepdims=True)  # rows with no key: NaN, as the kernel
    got = np.array(_ext.causal_softmax(mx.array(scores), offset=offset, window=window))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


@needs_kernel
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_16_bit_pools_under_float32_queries(monkeypatch, dtype, window):
    """The CPU default (float32 activations, 16-bit cache): decode rows and prefill chunks over the
    16-bit pools give the reference's float32 attention over the same stored values."""
    rng = np.random.default_rng(3)
    cache, _, queries, md, _ = make_step(rng, [1, 9, 1, 17], [70, 9, 5, 40], block_size=8, n_heads=9, n_kv=3)
    k_pool, v_pool = (p.astype(dtype) for p in cache.layer(0))
    q = mx.array(queries)  # (T, H, D) float32
    outs = []
    for backend in ("reference", "auto"):
        monkeypatch.setenv("METRALE_ATTENTION", backend)
        out = paged_attention(q, k_pool, v_pool, md, 0.25, sliding_window=window)
        assert out.dtype == mx.float32
        outs.append(np.array(out))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_pools(monkeypatch, dtype):
    ref, fast = both_backends(monkeypatch, [1, 1, 1, 6], [5, 40, 129, 9], dtype=dtype)
    np.testing.assert_allclose(fast, ref, rtol=2e-2, atol=2e-2)


@needs_kernel
def test_kernel_reads_the_pool_written_in_the_same_graph():
    cache = PagedKVCache(1, 4, 4, 1, 8)
    md = AttentionMetadata.build([1], [1], [[2]], 4)
    values = mx.arange(8, dtype=mx.float32).reshape(1, 1, 8)  # (T, n_kv, hd)
    k_pool, v_pool = cache.write(0, values, values, md.slot_mapping)
    out = _ext.paged_decode(mx.ones((1, 2, 8)), k_pool, v_pool, md.decode_block_tables, md.decode_context_lens,
                            scale=1.0, block_size=4, window=0)
    np.testing.assert_array_equal(np.array(out)[0, 1], np.arange(8))  # one key: its value, exactly


@needs_kernel
def test_out_of_range_block_gives_nan_not_a_crash():
    pool = mx.ones((2, 1, 4, 8))  # 2 blocks of 4
    out = kernel.paged_decode(mx.ones((3, 1, 8)), pool, pool, mx.array([[1], [9], [0]], dtype=mx.int32),
                              mx.array([3, 3, 2**30], dtype=mx.int32), scale=1.0, block_size=4, window=0)
    out = np.array(out)
    assert np.isfinite(out[0]).all() and np.isnan(out[1:]).all()


@needs_kernel
def test_paged_attention_rejects_block_outside_pool(monkeypatch):
    monkeypatch.setenv("METRALE_ATTENTION", "auto")
    cache = PagedKVCache(1, 2, 4, 1, 8)
    md = AttentionMetadata.build([1], [3], [[5]], 4)
    with pytest.raises(ValueError, match="outside the pool"):
        paged_attention(mx.ones((1, 1, 8)), *cache.layer(0), md, 1.0)


@needs_kernel
@pytest.mark.parametrize(
    "q_shape,pool_shape,tables_shape,match",
    [
        ((2, 4, 8), (2, 3, 4, 8), (2, 1), "multiple"),
        ((2, 4, 8), (2, 2, 4, 16), (2, 1), "head_dim"),
        ((2, 4, 8), (2, 2, 4, 8), (3, 1), "block_tables"),
        ((2, 4, 12), (2, 2, 4, 12), (2, 1), "multiple of 8"),
        ((2, 4, 264), (2, 2, 4, 264), (2, 1), "at most 256"),
        ((2, 4, 8), (8, 2, 8), (2, 1), "num_blocks, n_kv_heads, block_size"),
        ((2, 4, 8), (2, 2, 8, 8), (2, 1), "is not the pools' 8"),
    ],
)
def test_kernel_validates_shapes(q_shape, pool_shape, tables_shape, match):
    pool = mx.zeros(pool_shape)
    with pytest.raises(ValueError, match=match):
        kernel.paged_decode(mx.zeros(q_shape), pool, pool, mx.zeros(tables_shape, dtype=mx.int32),
                            mx.ones((2,), dtype=mx.int32), scale=1.0, block_size=4, window=0)


def test_backend_choice_is_validated(monkeypatch):
    monkeypatch.setenv("METRALE_ATTENTION", "fast")
    with pytest.raises(ValueError, match="auto, kernel, reference"):
        attention_backend()


def test_reference_fallback_when_not_built(monkeypatch):
    monkeypatch.delenv("METRALE_ATTENTION", raising=False)
    monkeypatch.setitem(_ext._state, "module", None)  # as if the build never ran
    assert attention_backend() == "reference"
    monkeypatch.setenv("METRALE_ATTENTION", "kernel")
    with pytest.raises(RuntimeError, match="not available"):
        attention_backend()
    monkeypatch.setenv("METRALE_ATTENTION", "auto")
    with pytest.raises(RuntimeError, match="not available"):
        _ext.paged_decode(None, None, None, None, None, scale=1.0, block_size=1, window=0)
    check([1, 3, 1], [9, 5, 30])


@needs_kernel
def test_kernel_keeps_the_write_in_place(monkeypatch):
    """Reading a pool through the kernel must not pin it: the next step's write still reuses it."""
    monkeypatch.setenv("METRALE_ATTENTION", "kernel")
    cache = PagedKVCache(num_layers=2, num_blocks=256, block_size=16, n_kv_heads=3, head_dim=64)  # 6 MiB/pool
    md = AttentionMetadata.build([1] * 8, [40] * 8, [[i * 4 + j for j in range(4)] for i in range(8)], 16)
    new_kv = mx.ones((8, 3, 64))  # (T, n_kv, hd)
    queries = mx.ones((8, 9, 64))  # (T, n_heads, hd)
    mx.eval(new_kv, queries)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(20):
        outs = [paged_attention(queries, *cache.write(layer, new_kv, new_kv, md.slot_mapping), md, 0.125)
                for layer in range(cache.num_layers)]
        mx.eval(outs)
    one_pool = cache.bytes // (2 * cache.num_layers)
    assert mx.get_peak_memory() - base < one_pool // 4, "a write copied a pool"
