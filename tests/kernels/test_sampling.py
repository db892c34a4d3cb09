"""The threaded argmax kernel against mx.argmax(x, axis=-1) on every instruction set: same indices, dtype
and shape, ties, infinities and NaNs included (skipped when the kernels are not built)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext as _ext
from kernels.sampling import argmax_fn, logsumexp_fn
from tests.kernels.isa_helpers import avx2_disassembly

kernel = _ext.load()
needs_kernel = pytest.mark.skipif(kernel is None or not hasattr(kernel, "argmax_rows"),
                                  reason="kernels not built: python -m kernels.build")
NAN, INF = math.nan, math.inf


def assert_same_as_mlx(x: mx.array) -> None:
    got, want = kernel.argmax_rows(x), mx.argmax(x, axis=-1)
    assert got.shape == want.shape and got.dtype == want.dtype == mx.uint32
    np.testing.assert_array_equal(np.array(got), np.array(want))


@needs_kernel
@pytest.mark.parametrize("row", [
    [1, NAN, 3], [NAN, 1, 3], [1, 3, NAN], [NAN, NAN], [1, 3, 3, 1], [-INF, -INF], [-INF, NAN], [INF, NAN, INF],
    [3, NAN, 5, NAN], [0.0, -0.0], [-0.0, 0.0], [7.0], [-INF] * 40, [INF] * 33, [-0.0] * 17 + [0.0] * 17,
], ids=str)
def test_special_values_match_mlx(isa, row):
    assert_same_as_mlx(mx.array(row, dtype=mx.float32))


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 5), (3, 17), (2, 3, 40), (1, 49152), (32, 128256), (1, 400000), (5, 70001)])
@pytest.mark.parametrize("nan_at", [None, "start", "middle", "end"])
def test_rows_with_ties_and_nans_match_mlx(isa, shape, nan_at):
    # rounded to integers: every row has many ties for its maximum, in several lanes and ranges
    x = np.round(np.random.default_rng(sum(shape)).standard_normal(shape) * 3).astype(np.float32)
    rows = x.reshape(-1, shape[-1])
    if nan_at is not None:
        column = {"start": 0, "middle": shape[-1] // 2 + 1, "end": shape[-1] - 1}[nan_at]
        rows[0, column] = NAN
        rows[-1, min(3, shape[-1] - 1)] = NAN  # a second NaN later in the row: the first one wins
    assert_same_as_mlx(mx.array(x))


@needs_kernel
def test_maximum_in_the_tail_and_strided_input(isa):
    x = np.zeros((4, 16 * 9 + 5), dtype=np.float32)
    x[np.arange(4), [16 * 9 + 4, 16 * 9, 3, 16 * 9 + 1]] = 1.0  # after the last whole vector, and before it
    assert_same_as_mlx(mx.array(x))
    y = mx.array(np.random.default_rng(3).standard_normal((300, 20)).astype(np.float32))
    assert_same_as_mlx(y.T)  # a transposed view: copied to rows first


@needs_kernel
def test_validation_and_fallback():
    with pytest.raises(ValueError, match="float32"):
        kernel.argmax_rows(mx.zeros((2, 3), dtype=mx.float16))
    with pytest.raises(ValueError, match="V >= 1"):
        kernel.argmax_rows(mx.zeros((2, 0)))
    argmax = argmax_fn("kernel")
    half = mx.array([[1.0, 3.0, 2.0]], dtype=mx.float16)
    assert argmax(half).tolist() == [1]  # other dtypes run mx.argmax


def test_reference_backend_is_mx_argmax():
    x = mx.array([[1.0, NAN, 3.0], [2.0, 5.0, 5.0]])
    assert argmax_fn("reference")(x).tolist() == mx.argmax(x, axis=-1).tolist() == [1, 1]


def reference_token(x: np.ndarray, scale: float, log2_min_p: float, u: float) -> tuple[int, float]:
    """The inverse CDF in float64: (token, u's distance to the nearest interval edge, relative to the total)."""
    y = (x.astype(np.float64) - x.max()) * scale
    q = np.where(y >= max(log2_min_p, -126.0), np.exp2(y), 0.0)
    cdf = np.cumsum(q)
    token = int(np.searchsorted(cdf, u * cdf[-1], side="left"))
    return token, float(np.min(np.abs(cdf - u * cdf[-1])) / cdf[-1])


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 7, 64, 1000, 128256])
@pytest.mark.parametrize("min_p", [0.0, 0.05])
def test_sample_full_rows_is_the_inverse_cdf(isa, vocab, min_p):
    rng = np.random.default_rng(vocab)
    rows = 24
    x = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    scale = (1.4426950408889634 / rng.uniform(0.3, 2.0, rows)).astype(np.float32)  # log2(e) / temperature
    log2_min_p = np.full(rows, np.log2(min_p) if min_p else -np.inf, dtype=np.float32)
    uniforms = rng.uniform(0.001, 0.999, rows).astype(np.float32)
    got = kernel.sample_full_rows(mx.array(x), mx.array(scale), mx.array(log2_min_p), mx.array(uniforms))
    assert got.dtype == mx.int32 and got.shape == (rows,)
    for r, token in enumerate(got.tolist()):
        want, margin = reference_token(x[r], float(scale[r]), float(log2_min_p[r]), float(uniforms[r]))
        assert token == want or margin < 1e-5, (r, token, want, margin)
        assert (x[r, token] - x[r].max()) * scale[r] >= log2_min_p[r]  # never below the min_p floor


@needs_kernel
def test_sample_full_rows_is_batch_invariant_and_handles_non_finite_rows(isa):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 3000)) * 2).astype(np.float32)
    x[1, 17] = NAN  # a NaN maximum: the mode (its index), as the MLX path's fallback
    x[2, 2999] = INF
    x[3, 5] = NAN  # a NaN below a finite maximum... is the argmax too (NaN wins): the mode
    x[4, :] = -INF  # no mass at all: the mode, index 0
    scale, floor, uniforms = (mx.full((6,), 1.44), mx.full((6,), -INF), mx.array(rng.uniform(0, 1, 6).astype(np.float32)))
    batch = kernel.sample_full_rows(mx.array(x), scale, floor, uniforms).tolist()
    assert batch[1:5] == [17, 2999, 5, 0]
    for r in range(6):
        alone = kernel.sample_full_rows(mx.array(x[r:r + 1]), scale[r:r + 1], floor[r:r + 1], uniforms[r:r + 1])
        assert alone.tolist() == [batch[r]]


@needs_kernel
def test_sample_full_rows_validation():
    ones = mx.ones((2,))
    with pytest.raises(ValueError, match="float32"):
        kernel.sample_full_rows(mx.zeros((2, 5), dtype=mx.float16), ones, ones, ones)
    with pytest.raises(ValueError, match=r"\(R,\)"):
        kernel.sample_full_rows(mx.zeros((2, 5)), mx.ones((3,)), ones, ones)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (32, 128256), (5, 1003)])
def test_logsumexp_rows_matches_mlx(isa, shape):
    x = mx.array((np.random.default_rng(shape[1]).standard_normal(shape) * 4).astype(np.float32))
    got = kernel.logsumexp_rows(x)
    assert got.shape == (shape[0],) and got.dtype == mx.float32
    exact = np.log(np.exp(np.array(x).astype(np.float64)).sum(axis=-1))
    np.testing.assert_allclose(np.array(got), exact, rtol=1e-6, atol=1e-6)
    # MLX sums 128k float32 values less exactly (~1e-5 relative here): the kernel is the closer one
    np.testing.assert_allclose(np.array(got), np.array(mx.logsumexp(x, axis=-1)), rtol=5e-5, atol=5e-5)


@needs_kernel
def test_logsumexp_rows_special_rows_and_fallback():
    x = mx.array([[0.0, -INF, 3.0], [-INF, -INF, -INF], [1.0, NAN, 2.0], [INF, 0.0, 1.0]])
    got = np.array(kernel.logsumexp_rows(x))
    assert np.isclose(got[0], np.log(1 + np.exp(3.0))) and np.isnan(got[1:]).all()
    with pytest.raises(ValueError, match="float32"):
        kernel.logsumexp_rows(mx.zeros((2, 3), dtype=mx.float16))
    half = mx.array([[0.0, 1.0]], dtype=mx.float16)
    assert np.isclose(logsumexp_fn("kernel")(half).item(), np.log(1 + np.e), atol=1e-2)  # MLX's ops


@needs_kernel
def test_the_avx2_argmax_loop_compares_eight_values_at_a_time():
    """GCC turned the 16-lane vector-extension loop this kernel had into scalar code for AVX2 (a `vucomiss`
    per value: 7.4 ms for (32, 128256) logits, slower than mx.argmax); the avx2 argmax_range compares whole
    ymm registers now."""
    out = avx2_disassembly("_ZN7metrale4avx26kernel12argmax_rangeEPKfll")
    if out is None:
        pytest.skip("no avx2 build object (kernels/build) or no objdump that disassembles one symbol")
    assert "argmax_range" in out, "the avx2 argmax_range symbol is gone: update this test"
    compares = [line for line in out.splitlines() if "vcmp" in line and "ps" in line and "%ymm" in line]
    assert any("lt" in line or "gt" in line for line in compares), "the avx2 argmax loop no longer compares ymm"
