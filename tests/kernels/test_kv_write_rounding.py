"""kv_write of float32 rows into float16 / bfloat16 pools (kernels/csrc/kv_write.cpp, the kernel sets'
store_floats): bit for bit mlx's astype of the rows, on every kernel set this CPU runs (the `isa` fixture),
through row tails of every length mod 8, and on the values where rounding has edges (halfway ties, the
largest finite values, overflow to inf, subnormals, signed zeros, inf, NaN). The cache then writes float32
rows straight into its 16-bit pools: one node per pool and layer instead of two."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext
from kvcache.storage import PagedKVCache
from tests.kvcache.pool_layout import as_slot_rows

needs_kernels = pytest.mark.skipif(ext.load() is None, reason="kernels not built: python -m kernels.build")

DTYPES = [mx.float16, mx.bfloat16]


def edge_values(dtype) -> np.ndarray:
    """float32 values on the rounding edges of `dtype`, (n,)."""
    info = {mx.float16: (65504.0, 2.0**-24, 10), mx.bfloat16: (3.3895e38, 2.0**-133, 7)}[dtype]
    largest, tiny, mantissa = info
    ulp_one = 2.0 ** -mantissa
    with np.errstate(over="ignore"):  # largest * 2 is inf in float32 for bfloat16: wanted
        return np.array([
            0.0, -0.0, 1.0, -1.0, 1.0 + ulp_one / 2, 1.0 + 1.5 * ulp_one, 1.0 + ulp_one / 2 + 2.0**-20, largest,
            -largest, largest * (1 + ulp_one / 4), largest * 2, tiny, tiny / 2, tiny * 0.75, -tiny * 3.5,
            np.inf, -np.inf, np.nan, 3.14159265, -2.718281828, 1e-3, 12345.678,
        ], dtype=np.float64).astype(np.float32)


def as_bits(a: mx.array) -> np.ndarray:
    return np.array(mx.view(a, mx.uint16))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(1, 1), (1, 7), (3, 5), (2, 8), (3, 12), (4, 64), (2, 100)])
def test_float32_rows_round_into_the_pool_as_astype(isa, dtype, heads, head_dim):
    rng = np.random.default_rng(heads * 1000 + head_dim)
    rows = rng.standard_normal((9, heads, head_dim)).astype(np.float32) * np.float32(50.0)  # (T, H, hd)
    flat = rows.reshape(-1)
    edges = edge_values(dtype)
    flat[: min(len(edges), flat.size)] = edges[: flat.size]
    pool = mx.zeros((3, heads, 4, head_dim), dtype=dtype)  # 3 blocks of 4 slots
    slots = mx.array(np.array([3, 0, 11, 5, 1, 2, 4, 6, 7], dtype=np.int32))
    out = as_slot_rows(ext.load().kv_write(pool, mx.array(rows), slots))  # (12, H, hd) dtype
    mx.eval(out)
    want = mx.array(rows).astype(dtype)
    got = as_bits(out)[np.array(slots)]
    expected = as_bits(want)
    nan = np.isnan(np.array(want.astype(mx.float32)))
    np.testing.assert_array_equal(got[~nan], expected[~nan])
    assert np.isnan(np.array(out.astype(mx.float32))[np.array(slots)][nan]).all()  # NaN stays NaN
    assert not as_bits(out)[[8, 9, 10]].any()  # untouched slots stay zero


@needs_kernels
def test_rows_of_another_dtype_are_refused():
    pool = mx.zeros((1, 1, 4, 8), dtype=mx.float16)
    for rows in (mx.zeros((1, 1, 8), dtype=mx.bfloat16), mx.zeros((1, 1, 8), dtype=mx.int32)):
        with pytest.raises(ValueError, match="float32 into a float16 / bfloat16 pool"):
            ext.load().kv_write(pool, rows, mx.array([0], dtype=mx.int32))


def node_kinds(*arrays: mx.array) -> list[str]:
    """The primitives of the graph behind `arrays`, by name (mx.export_to_dot's labels)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "graph.dot")
        mx.export_to_dot(path, *arrays)
        return re.findall(r'^\s*\{?\s*\S+ \[label\s*=\s*"([^"\s]*)', Path(path).read_text(), flags=re.M)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cache_writes_float32_rows_without_a_cast_node(dtype):
    """PagedKVCache.write hands float32 rows to kv_write (no AsType node), the pool holding astype's bits."""
    cache = PagedKVCache(num_layers=2, num_blocks=4, block_size=4, n_kv_heads=2, head_dim=12, dtype=dtype)
    rng = np.random.default_rng(3)
    keys, values = (mx.array(rng.standard_normal((5, 2, 12)).astype(np.float32)) for _ in "kv")
    k_pool, v_pool = cache.write(1, keys, values, mx.array(np.arange(2, 7, dtype=np.int32)))
    kinds = node_kinds(k_pool, v_pool)
    assert kinds.count("KvWriteCPU") == 2 and "AsType" not in kinds, kinds
    mx.eval(k_pool, v_pool)
    np.testing.assert_array_equal(as_bits(as_slot_rows(k_pool))[2:7], as_bits(keys.astype(dtype)))
    np.testing.assert_array_equal(as_bits(as_slot_rows(v_pool))[2:7], as_bits(values.astype(dtype)))
