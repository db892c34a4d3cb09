"""ext.huge_page_copy and the loader's packing (qmm.pack): the packed weights a decode step streams, on 2 MiB
transparent huge pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kernels import ext, qmm
from kernels.runtime import mx

needs_kernel = pytest.mark.skipif(ext.load() is None or not hasattr(ext.load(), "huge_page_copy"),
                                  reason="kernels not built: python -m kernels.build")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_ALLOWED = THP.exists() and ("[always]" in THP.read_text() or "[madvise]" in THP.read_text())
MIB = 1 << 20
ROOT = str(Path(__file__).resolve().parents[2])


def random_bytes(shape, seed):
    return mx.random.randint(0, 256, shape, dtype=mx.int32, key=mx.random.key(seed)).astype(mx.uint8)


@needs_kernel
@pytest.mark.parametrize("dtype", [mx.uint8, mx.float16, mx.float32])
def test_copy_keeps_values_shape_and_dtype(dtype):
    a = (random_bytes((40, 3, 32768), 1).astype(dtype) if dtype != mx.uint8 else random_bytes((40, 3, 32768), 1))
    mx.eval(a)
    h = ext.huge_page_copy(a)
    assert h.shape == a.shape and h.dtype == a.dtype
    assert mx.array_equal(h, a).item()
    assert mx.array_equal(h[7] * 2, a[7] * 2).item()  # usable by other ops as a normal array


@needs_kernel
def test_small_and_strided_arrays_come_back_as_they_are():
    small = random_bytes((64, 1024), 2)  # 64 KiB: under one huge page
    assert ext.huge_page_copy(small) is not None
    assert mx.array_equal(ext.huge_page_copy(small), small).item()
    strided = random_bytes((3 * MIB // 512, 1024), 3)[:, ::2]  # not row-contiguous: copied contiguous first
    assert mx.array_equal(ext.huge_page_copy(strided), strided).item()


COUNT_HUGE_PAGES = """
from kernels import ext
from kernels.runtime import mx
a = mx.random.randint(0, 256, (9 * 1024, 1024), dtype=mx.int32).astype(mx.uint8)  # 9 MiB
mx.eval(a)
mx.clear_cache()
before = ext.anon_huge_page_bytes()
h = ext.huge_page_copy(a)
mx.eval(h)
assert mx.array_equal(h, a).item()
print(before, ext.anon_huge_page_bytes())
"""


@needs_kernel
@pytest.mark.skipif(not THP_ALLOWED, reason="transparent huge pages are off here")
def test_buffer_reports_huge_pages_where_thp_allows():
    """In a fresh process (nothing else there frees huge pages meanwhile): a 9 MiB copy has 4 whole
    2 MiB pages past its first 2 MiB boundary, and AnonHugePages grows by them."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", COUNT_HUGE_PAGES], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    before, after = (int(v) for v in out.stdout.split())
    assert after >= before + 4 * 2 * MIB


PACK_ON_HUGE_PAGES = """
from kernels import ext, qmm
from kernels.runtime import mx
n, k = 4096, 8192  # 16 MiB of 4-bit weights
q = mx.random.randint(0, 2**31, (n, k // 8), dtype=mx.int32).view(mx.uint32)
s = mx.random.uniform(shape=(n, k // 32)).astype(mx.float16)
mx.eval(q, s)
mx.clear_cache()
before = ext.anon_huge_page_bytes()
packed = qmm.pack(q, s, s, 4, 32)
print(before, ext.anon_huge_page_bytes())
"""


@needs_kernel
@pytest.mark.skipif(not THP_ALLOWED, reason="transparent huge pages are off here")
def test_the_loaders_packing_puts_the_weights_on_huge_pages():
    """qmm.pack (what the loader's modules hold) writes the layout straight into advised memory: a 16 MiB
    weight has 7 whole 2 MiB pages past its first boundary."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", PACK_ON_HUGE_PAGES], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    before, after = (int(v) for v in out.stdout.split())
    assert after >= before + 7 * 2 * MIB


@needs_kernel
@pytest.mark.skipif(THP_ALLOWED, reason="transparent huge pages are on here")
def test_without_thp_the_array_is_returned_unchanged():
    a = random_bytes((3 * MIB // 1024, 1024), 5)
    mx.eval(a)
    assert mx.array_equal(ext.huge_page_copy(a), a).item()


@needs_kernel
def test_quantized_linear_on_huge_pages_matches_the_mlx_layer():
    """The loader's module moves its packed weight (8 MiB at this size) and computes as before."""
    rng = np.random.default_rng(6)
    layer = mx.array(rng.standard_normal((4096, 4096)).astype(np.float32))
    lin = qmm.QuantizedLinearCPU(*qmm.pack(*mx.quantize(layer, group_size=32, bits=4), 4, 32), bits=4,
                                 group_size=32, columns=[4096], activation_bits=16)
    plain = qmm.pack(*mx.quantize(layer, group_size=32, bits=4), 4, 32)
    x = mx.array(rng.standard_normal((1, 4096)).astype(np.float32))
    (ref,) = ext.quantized_matmul(x, *plain, bits=4, group_size=32, columns=[4096], activation_bits=16)
    np.testing.assert_array_equal(np.array(lin(x)), np.array(ref))
