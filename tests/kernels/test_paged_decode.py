"""The paged decode kernel (kernels/csrc/attention_kernel.h decode_range, paged_decode.cpp) against a float64
numpy oracle over the values the pools hold: GQA groups 1..12, head_dim 8..128 (the 16-wide and 8-wide
paths), float32 / float16 / bfloat16 / int8 (q8, groups of 8 and 32) pools, contexts that end on, before and
after block boundaries, one-token and empty contexts, windows, and long contexts split over tasks (flash
decoding partials and their merge). Skipped when the kernels are not built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext
from tests.kernels.test_kv_int8 import dequantize_np, quantize_np
from tests.kvcache.pool_layout import as_pool

kernel = ext.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="kernel not built: python -m kernels.build")

ROOT = Path(__file__).resolve().parents[2]


def make_pools(rng, num_blocks, block_size, n_kv, hd, dtype, q8_group=32):
    """(k_pool, v_pool) mx arrays of `dtype` (num_blocks, n_kv, block_size, row) and their values as float64,
    slot by slot (num_slots, n_kv, hd)."""
    pools, values = [], []
    for _ in range(2):
        x = rng.standard_normal((num_blocks * block_size, n_kv, hd)).astype(np.float32)
        x[..., 1] *= 6.0  # an outlier channel, as real keys have
        if dtype == "int8":
            rows = quantize_np(x, q8_group)  # (num_slots, n_kv, hd + 2 hd / group)
            pools.append(mx.array(as_pool(rows, block_size)))
            values.append(dequantize_np(rows, hd))
        else:
            rows = mx.array(x).astype(getattr(mx, dtype))
            pools.append(as_pool(rows, block_size))
            values.append(np.array(rows.astype(mx.float32)).astype(np.float64))
    return pools, values


def scattered_tables(rng, contexts, block_size, max_blocks):
    """(B, max_blocks) int32 tables of distinct random blocks (unused entries 0) and the block count."""
    need = [max(1, -(-ctx // block_size)) for ctx in contexts]
    num_blocks = sum(need) + 2
    order = rng.permutation(num_blocks)
    tables = np.zeros((len(contexts), max_blocks), np.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[used : used + n]
        used += n
    return tables, num_blocks


def oracle(q, k, v, tables, contexts, block_size, scale, window):
    """float64 attention of q (B, H, hd) over the slots the tables name; rows with no key are NaN."""
    B, H, hd = q.shape
    rep = H // k.shape[1]
    out = np.full((B, H, hd), np.nan)
    for b, ctx in enumerate(contexts):
        start = max(0, ctx - window) if window else 0
        t = np.arange(start, ctx)
        if t.size == 0:
            continue
        slots = tables[b, t // block_size] * block_size + t % block_size
        for h in range(H):
            keys, vals = k[slots, h // rep], v[slots, h // rep]  # (n, hd)
            s = keys @ q[b, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[b, h] = p @ vals / p.sum()
    return out


def run_case(seed, contexts, n_heads, n_kv, hd, dtype="float32", block_size=16, window=0, scale=None, q8_group=32):
    """(kernel output, oracle) as float64 arrays (B, n_heads, hd)."""
    rng = np.random.default_rng(seed)
    max_blocks = max(1, max(-(-c // block_size) for c in contexts))
    tables, num_blocks = scattered_tables(rng, contexts, block_size, max_blocks)
    (k_pool, v_pool), (k, v) = make_pools(rng, num_blocks, block_size, n_kv, hd, dtype, q8_group)
    q = rng.standard_normal((len(contexts), n_heads, hd)).astype(np.float32)
    scale = hd**-0.5 if scale is None else scale
    out = kernel.paged_decode(mx.array(q), k_pool, v_pool, mx.array(tables), mx.array(np.array(contexts, np.int32)),
                              scale=scale, block_size=block_size, window=window)
    return np.array(out).astype(np.float64), oracle(q, k, v, tables, contexts, block_size, scale, window)


TOL = dict(rtol=1e-4, atol=1e-5)  # float32 accumulation over the pools' exact values


@needs_kernel
@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (8, 4), (9, 3), (32, 8), (24, 8), (5, 1), (7, 1), (8, 1), (12, 1)])
def test_gqa_groups(n_heads, n_kv):
    got, want = run_case(1, [1, 16, 17, 40, 130], n_heads, n_kv, 64)
    np.testing.assert_allclose(got, want, **TOL)


@needs_kernel
@pytest.mark.parametrize("hd", [8, 24, 64, 128])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_head_dims_and_pool_dtypes(hd, dtype):
    """hd 64 / 128: the 16-wide path with AVX-512; 8 and 24: the 8-wide one (q8 groups: the whole row)."""
    got, want = run_case(2, [3, 33, 70], 8, 2, hd, dtype, q8_group=32 if hd % 32 == 0 else hd)
    np.testing.assert_allclose(got, want, **TOL)


@needs_kernel
@pytest.mark.parametrize("q8_group", [8, 16, 32, 64])
def test_int8_scale_groups(q8_group):
    got, want = run_case(3, [5, 48, 100], 12, 4, 64, "int8", q8_group=q8_group)
    np.testing.assert_allclose(got, want, **TOL)


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_contexts_around_block_boundaries(block_size):
    contexts = [1, block_size - 1 or 1, block_size, block_size + 1, 2 * block_size, 2 * block_size + 1, 77]
    got, want = run_case(4, contexts, 6, 2, 64, "float16", block_size=block_size)
    np.testing.assert_allclose(got, want, **TOL)


@needs_kernel
def test_one_token_context_returns_its_value_row():
    got, want = run_case(5, [1, 1], 4, 2, 64, "float16")
    np.testing.assert_allclose(got, want, **TOL)


@needs_kernel
def test_empty_context_is_nan_and_leaves_the_other_rows_alone():
    got, want = run_case(6, [0, 21, 0, 300], 8, 2, 64)
    assert np.isnan(got[[0, 2]]).all()
    np.testing.assert_allclose(got[[1, 3]], want[[1, 3]], **TOL)


@needs_kernel
@pytest.mark.parametrize("window", [1, 7, 16, 300, 5000])
def test_windows_start_anywhere_in_a_block(window):
    got, want = run_case(7, [2, 17, 299, 1200], 8, 2, 64, "float16", window=window)
    np.testing.assert_allclose(got, want, **TOL)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_long_contexts_split_and_merged(dtype):
    """Few long rows: with more than one kernel thread each row is split into parts of whole blocks and
    merged (plan_tasks, merge_partials); large scores make the parts' maxima differ by a lot."""
    got, want = run_case(8, [4000, 1025], 32, 8, 64, dtype, scale=0.6)
    np.testing.assert_allclose(got, want, **TOL)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_one_short_row_is_split_so_every_thread_has_a_part(dtype):
    """One stream's decode at a few hundred keys: parts of kMinSplitKeys (256) would leave a thread idle, so
    the row is cut into one part per thread (plan_tasks' short split), merged like the long ones."""
    got, want = run_case(12, [200], 32, 8, 64, dtype, scale=0.6)
    np.testing.assert_allclose(got, want, **TOL)
    got, want = run_case(13, [300], 24, 8, 128, dtype, window=170, scale=0.5)
    np.testing.assert_allclose(got, want, **TOL)


SPLIT_SCRIPT = """
import numpy as np
from tests.kernels import test_paged_decode as t
for dtype, window in (("float16", 0), ("int8", 0), ("float32", 900)):
    got, want = t.run_case(9, [3000, 700, 16], 9, 3, 64, dtype, window=window, scale=0.5)
    np.testing.assert_allclose(got, want, **t.TOL)
    got, want = t.run_case(14, [300], 24, 8, 128, dtype, window=window // 4, scale=0.5)  # 3 short parts
    np.testing.assert_allclose(got, want, **t.TOL)
print("ok")
"""


@needs_kernel
def test_split_and_merge_with_more_threads_than_cpus():
    """The split depends on the thread count, fixed per process at the first kernel call: force 3 threads
    in a child so the parts, the merge and a window crossing part boundaries run on any machine."""
    env = {**os.environ, "METRALE_ATTENTION_THREADS": "3", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SPLIT_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


@needs_kernel
def test_every_instruction_set_agrees(isa):
    got, want = run_case(10, [1, 31, 600], 24, 8, 128, "float16")
    np.testing.assert_allclose(got, want, **TOL)
    got, want = run_case(11, [9, 250], 9, 3, 64, "int8")
    np.testing.assert_allclose(got, want, **TOL)
