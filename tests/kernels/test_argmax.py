"""The threaded argmax kernel against mx.argmax(x, axis=-1) on every instruction set: same indices, dtype
and shape, ties, infinities and NaNs included (skipped when the kernels are not built)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext as _ext
from kernels.argmax import argmax_fn

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
