"""The fused gated activation kernels against MLX's expressions and a float64 oracle.

Kernel tests are skipped when kernels/ is not built; the backend selection and the reference
path are tested either way.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kernels import ext as _ext
from kernels.activations import gated_activation
from kernels.backend import activation_backend

kernel = _ext.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="kernel not built: python -m kernels.build")

KERNEL_KINDS = {"silu": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul"}
MLX_EXPR = {
    "silu": lambda g, u: nn.silu(g) * u,
    "gelu_pytorch_tanh": lambda g, u: nn.gelu_approx(g) * u,
    "gelu": lambda g, u: nn.gelu(g) * u,
}
# Against the float64 oracle. gelu's sigmoid argument 2z = g (c1 + c3 g^2) is rounded to float32
# before the sigmoid (as in any float32 evaluation), so for gate < 0 the relative error of the
# output grows with |2z| * 2 ulp (|2z| <= 87 where the output is not flushed to 0); silu ~2e-7.
ORACLE_RTOL = {"silu": 1e-6, "gelu_pytorch_tanh": 2e-5}
SPECIALS = np.array([0.0, -0.0, 1e-30, -1e-30, 1.5, -1.5, 20.0, -20.0, 87.5, -87.5, -87.9, -88.1, 88.5, -88.5,
                     100.0, -100.0, 1e20, -1e20, 3e38, -3e38, np.inf, -np.inf, np.nan], dtype=np.float32)


def oracle(kind: str, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """float64 act(gate) * up without cancellation: gelu_tanh(g) = 0.5 g (1 + tanh z) = g sigmoid(2 z)."""
    g, u = gate.astype(np.float64), up.astype(np.float64)
    t = g if kind == "silu" else 2 * np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)
    with np.errstate(over="ignore", invalid="ignore"):
        sig = np.where(t >= 0, 1 / (1 + np.exp(-np.abs(t))), np.exp(-np.abs(t)) / (1 + np.exp(-np.abs(t))))
        return g * sig * u


def inputs(shape, seed=0, scale=4.0, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    gate = (rng.standard_normal(shape) * scale).astype(np.float32)
    up = rng.standard_normal(shape).astype(np.float32)
    return mx.array(gate).astype(dtype), mx.array(up).astype(dtype)


def run_kernel(kind, gate, up):
    return getattr(kernel, KERNEL_KINDS[kind])(gate, up)


@needs_kernel
@pytest.mark.parametrize("kind", list(KERNEL_KINDS))
@pytest.mark.parametrize("shape", [(1, 1536), (32, 1536), (512, 1536), (3, 7), (13,), (2, 3, 5), (), (0, 8)])
def test_kernel_matches_mlx_and_oracle(kind, shape):
    """(512, 1536) runs on the thread pool, the others on one thread; odd sizes end in a tail."""
    gate, up = inputs(shape)
    got = run_kernel(kind, gate, up)
    assert got.shape == gate.shape and got.dtype == mx.float32
    got = np.array(got)
    # mlx's own error: its exp is ~4e-6 relative for x < -20, and 1 + tanh(z) cancels for gate < 0
    np.testing.assert_allclose(got, np.array(MLX_EXPR[kind](gate, up)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, oracle(kind, np.array(gate), np.array(up)), rtol=ORACLE_RTOL[kind], atol=1e-30)


@needs_kernel
@pytest.mark.parametrize("kind", list(KERNEL_KINDS))
def test_kernel_within_1e6_of_mlx_where_mlx_is_accurate(kind):
    gate = mx.array(np.linspace(-1.0, 30.0, 20_001, dtype=np.float32))  # no cancellation, no exp(< -20)
    up = mx.array(np.linspace(-3.0, 3.0, 20_001, dtype=np.float32))
    got, want = np.array(run_kernel(kind, gate, up)), np.array(MLX_EXPR[kind](gate, up))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)


@needs_kernel
@pytest.mark.parametrize("kind", list(KERNEL_KINDS))
def test_kernel_full_range_against_oracle(kind):
    gate = np.linspace(-100.0, 100.0, 40_001, dtype=np.float32)
    up = np.full_like(gate, -1.25)
    got = np.array(run_kernel(kind, mx.array(gate), mx.array(up)))
    want = oracle(kind, gate, up)
    np.testing.assert_allclose(got, want, rtol=ORACLE_RTOL[kind], atol=1e-30)


@needs_kernel
@pytest.mark.parametrize("kind", list(KERNEL_KINDS))
def test_extreme_values_agree_with_mlx(kind):
    """Every (gate, up) pair of specials: NaN and +-inf where mlx has them, the finite values close."""
    g, u = np.meshgrid(SPECIALS, SPECIALS, indexing="ij")
    gate, up = mx.array(g), mx.array(u)
    got, want = np.array(run_kernel(kind, gate, up)), np.array(MLX_EXPR[kind](gate, up))
    for check in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(check(got), check(want))
    finite = np.isfinite(want)
    # atol: mlx's 1 + tanh(z) is 0 for z < -9, where the kernel keeps gelu's ~1e-30 products
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-30)


@needs_kernel
@pytest.mark.parametrize("kind", list(KERNEL_KINDS))
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_types_are_computed_in_float32(kind, dtype):
    gate, up = inputs((7, 301), seed=3, dtype=dtype)
    gate = mx.concatenate([gate.reshape(-1), mx.array(SPECIALS).astype(dtype)])
    up = mx.concatenate([up.reshape(-1), mx.ones((SPECIALS.size,), dtype=dtype)])
    got = run_kernel(kind, gate, up)
    assert got.dtype == dtype
    # one rounding of the float32 result: the bits of mlx's own float32 -> half conversion
    want = run_kernel(kind, gate.astype(mx.float32), up.astype(mx.float32)).astype(dtype)
    nan = np.isnan(np.array(want.astype(mx.float32)))
    np.testing.assert_array_equal(np.isnan(np.array(got.astype(mx.float32))), nan)
    np.testing.assert_array_equal(np.array(got.view(mx.uint16))[~nan], np.array(want.view(mx.uint16))[~nan])
    n = 7 * 301  # the random part, against mlx's expression computed in the half type
    np.testing.assert_allclose(np.array(got[:n].astype(mx.float32)),
                               np.array(MLX_EXPR[kind](gate[:n], up[:n]).astype(mx.float32)), rtol=2e-2, atol=2e-2)


@needs_kernel
@pytest.mark.parametrize("kind", list(KERNEL_KINDS))
def test_non_contiguous_and_aliased_inputs(kind):
    base, other = inputs((24, 40), seed=5)
    cases = [(base.T, other.T), (base[:, 1::3], other[:, 2::3]), (base, base), (base * 1.0, other + 0.0)]
    for gate, up in cases:  # transposed, strided, one array twice, temporaries (donated to the output)
        want = oracle(kind, np.array(gate), np.array(up))
        np.testing.assert_allclose(np.array(run_kernel(kind, gate, up)), want, rtol=ORACLE_RTOL[kind], atol=1e-30)


@needs_kernel
def test_kernel_works_inside_compile_and_rejects_grad():
    gate, up = inputs((4, 9))
    fused = mx.compile(lambda g, u: kernel.silu_mul(g, u) * 2)
    want = 2 * oracle("silu", np.array(gate), np.array(up))
    np.testing.assert_allclose(np.array(fused(gate, up)), want, rtol=1e-6)
    with pytest.raises(ValueError, match="vjp"):  # inference only: no derivative is defined
        mx.grad(lambda g: kernel.silu_mul(g, up).sum())(gate)


@needs_kernel
@pytest.mark.parametrize(
    "gate,up,match",
    [
        (mx.zeros((2, 3)), mx.zeros((3, 2)), "same shape"),
        (mx.zeros((2, 3)), mx.zeros((1, 3)), "same shape"),  # no broadcasting
        (mx.zeros((2, 3)), mx.zeros((2, 3), dtype=mx.float16), "dtype"),
        (mx.zeros((2, 3), dtype=mx.int32), mx.zeros((2, 3), dtype=mx.int32), "float32, float16 or bfloat16"),
    ],
)
def test_kernel_validates_inputs(gate, up, match):
    for fn in (kernel.silu_mul, kernel.gelu_tanh_mul):
        with pytest.raises(ValueError, match=match):
            fn(gate, up)


@needs_kernel
@pytest.mark.parametrize("kind", list(KERNEL_KINDS))
def test_gated_activation_uses_the_kernel_on_cpu(monkeypatch, kind):
    monkeypatch.delenv("METRALE_KERNELS", raising=False)
    assert activation_backend() == "kernel"
    gate, up = inputs((5, 64))
    np.testing.assert_array_equal(np.array(gated_activation(gate, up, kind)), np.array(run_kernel(kind, gate, up)))


@pytest.mark.parametrize("kind", list(MLX_EXPR))
def test_reference_is_forced_by_env(monkeypatch, kind):
    monkeypatch.setenv("METRALE_KERNELS", "reference")
    monkeypatch.setattr(_ext, "load", lambda: pytest.fail("the reference path must not touch the extension"))
    assert activation_backend() == "reference"
    gate, up = inputs((3, 7))
    np.testing.assert_array_equal(np.array(gated_activation(gate, up, kind)), np.array(MLX_EXPR[kind](gate, up)))


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_inputs_without_a_kernel_use_the_mlx_expression(monkeypatch, backend):
    """kind "gelu" (erf), mixed dtypes (mlx promotes) and float64 run the expression on any backend."""
    monkeypatch.setenv("METRALE_KERNELS", backend)
    gate, up = inputs((3, 7))
    with mx.stream(mx.cpu):  # float64 is CPU only
        cases = [(gate, up, "gelu"), (gate.astype(mx.float16), up, "silu"),
                 (gate.astype(mx.float64), up.astype(mx.float64), "gelu_pytorch_tanh")]
        for g, u, kind in cases:
            got = gated_activation(g, u, kind)
            want = MLX_EXPR[kind](g, u)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_gated_activation_validates_arguments(monkeypatch, backend):
    monkeypatch.setenv("METRALE_KERNELS", backend)
    with pytest.raises(ValueError, match="same shape"):
        gated_activation(mx.zeros((2, 3)), mx.zeros((1, 3)), "silu")
    with pytest.raises(ValueError, match="gelu_pytorch_tanh"):
        gated_activation(mx.zeros((2, 3)), mx.zeros((2, 3)), "relu")
    monkeypatch.setenv("METRALE_KERNELS", "fast")
    with pytest.raises(ValueError, match="auto, kernel, reference"):
        gated_activation(mx.zeros((2, 3)), mx.zeros((2, 3)), "gelu")


def test_fallback_when_not_built(monkeypatch):
    monkeypatch.delenv("METRALE_KERNELS", raising=False)
    monkeypatch.setitem(_ext._state, "module", None)  # as if the build never ran
    assert activation_backend() == "reference"
    gate, up = inputs((3, 7))
    np.testing.assert_array_equal(np.array(gated_activation(gate, up, "silu")), np.array(MLX_EXPR["silu"](gate, up)))
    monkeypatch.setenv("METRALE_KERNELS", "kernel")
    with pytest.raises(RuntimeError, match="not available"):
        gated_activation(gate, up, "silu")


def test_build_without_activation_kernels_falls_back(monkeypatch, caplog):
    monkeypatch.delenv("METRALE_KERNELS", raising=False)
    monkeypatch.setitem(_ext._state, "module", object())  # a stale build: attention kernels only
    monkeypatch.delitem(_ext._state, "activations", raising=False)
    with caplog.at_level(logging.WARNING, logger="kernels.ext"):
        assert activation_backend() == "reference"
    assert "Rebuild" in caplog.text


@needs_kernel
def test_kernel_writes_over_fresh_matmul_outputs():
    """In an MLP, gate and up are fresh matmul outputs nobody else holds: the result takes gate's
    buffer, so the activation adds no allocation to the peak of the two projections alone."""
    x, w_gate, w_up = (mx.random.normal(shape, key=mx.random.key(i)) for i, shape in
                       enumerate([(64, 96), (256, 96), (256, 96)]))
    mx.eval(x, w_gate, w_up)

    def peak(build):
        mx.eval(build())  # warm-up: the allocator's cache holds the buffers afterwards
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        out = build()
        mx.eval(out)
        return mx.get_peak_memory() - base, out

    projections, _ = peak(lambda: [x @ w_gate.T, x @ w_up.T])
    fused, out = peak(lambda: kernel.silu_mul(x @ w_gate.T, x @ w_up.T))  # (64, 256)
    assert fused - projections < out.nbytes // 2, "the activation allocated its output"
    want = oracle("silu", np.array(x @ w_gate.T), np.array(x @ w_up.T))
    np.testing.assert_allclose(np.array(out), want, rtol=1e-6, atol=1e-30)
