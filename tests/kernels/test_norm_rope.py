"""The fused RMSNorm and RoPE kernels against MLX's own CPU ops, on every instruction set
(skipped when the kernels are not built)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext as _ext
from kernels.norm_rope import RMSNorm, rope_inv_frequencies, rope_qk, rope_tables

kernel = _ext.load()
needs_kernel = pytest.mark.skipif(kernel is None or not hasattr(kernel, "rope_qk"),
                                  reason="kernels not built: python -m kernels.build")


def normal(shape, seed=0, scale=1.0):
    return mx.array((np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32))


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 5, 128), (2, 37), (300, 96)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_mlx(isa, shape, offset):
    x, w = normal(shape, 1, 3.0), normal(shape[-1:], 2)
    got = kernel.rms_norm(x, w, eps=1e-5, weight_offset=offset)
    want = mx.fast.rms_norm(x, w + offset, 1e-5)
    assert got.shape == x.shape and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-6, atol=2e-6)


@needs_kernel
def test_rms_norm_strided_input_and_validation():
    x, w = normal((16, 24), 3), normal((16,), 4)
    np.testing.assert_allclose(np.array(kernel.rms_norm(x.T, w, eps=1e-6)), np.array(mx.fast.rms_norm(x.T, w, 1e-6)),
                               rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="float32"):
        kernel.rms_norm(x.astype(mx.float16), w[:1].astype(mx.float16), eps=1e-6)


def reference_rope(x, positions, dims, traditional, base, scale, freqs):
    """mx.fast.rope with a position per token: x (T, H, D) as (T, H, 1, D) rows."""
    t, h, d = x.shape
    out = mx.fast.rope(x.reshape(t, h, 1, d), dims, traditional=traditional, base=base, scale=scale,
                       offset=positions, freqs=freqs)
    return out.reshape(t, h, d)


@needs_kernel
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("base,scale,freqs", [(10000.0, 1.0, None), (100000.0, 0.25, None),
                                              (None, 1.0, "freqs")])
@pytest.mark.parametrize("tokens,head_dim", [(1, 64), (9, 64), (33, 128), (5, 20)])
def test_rope_qk_matches_mlx(isa, traditional, base, scale, freqs, tokens, head_dim):
    q, k = normal((tokens, 9, head_dim), 5), normal((tokens, 3, head_dim), 6)
    positions = mx.array(np.random.default_rng(7).integers(0, 4000, tokens).astype(np.int32))
    if freqs is not None:
        freqs = 10000.0 ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim) * 1.5
    cos, sin = rope_tables(positions, rope_inv_frequencies(head_dim, base, freqs), scale)
    q_got, k_got = rope_qk(q, k, cos, sin, traditional)
    for got, x in ((q_got, q), (k_got, k)):
        want = reference_rope(x, positions, head_dim, traditional, base, scale, freqs)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_rope_qk_validation():
    q, k = normal((2, 4, 8)), normal((2, 2, 8))
    cos = sin = mx.zeros((2, 4))
    with pytest.raises(ValueError, match="cos and sin"):
        kernel.rope_qk(q, k, cos[:, :3], sin[:, :3], traditional=False)
    with pytest.raises(ValueError, match="float32"):
        kernel.rope_qk(q.astype(mx.float16), k, cos, sin, traditional=False)


@needs_kernel
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_module_kernel_and_reference_agree(monkeypatch, offset):
    x = normal((4, 48), 8, 2.0)

    class Norm(RMSNorm):
        weight_offset = offset

    monkeypatch.setenv("METRALE_KERNELS", "kernel")
    fused = Norm(48, eps=1e-6)
    monkeypatch.setenv("METRALE_KERNELS", "reference")
    plain = Norm(48, eps=1e-6)
    plain.weight = fused.weight = normal((48,), 9)
    np.testing.assert_allclose(np.array(fused(x)), np.array(plain(x)), rtol=2e-6, atol=2e-6)
    half = x.astype(mx.bfloat16)  # not float32: MLX's own op on every backend
    assert mx.array_equal(fused(half), mx.fast.rms_norm(half, fused.weight + offset, 1e-6)).item()


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 576), (32, 2048), (3, 5, 128), (2, 37)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(isa, shape, offset):
    x, residual, w = normal(shape, 8, 2.0), normal(shape, 9, 5.0), normal(shape[-1:], 10)
    h, normed = kernel.add_rms_norm(x, residual, w, eps=1e-5, weight_offset=offset)
    want_h = residual + x
    want = kernel.rms_norm(want_h, w, eps=1e-5, weight_offset=offset)
    np.testing.assert_array_equal(np.array(h), np.array(want_h))
    np.testing.assert_array_equal(np.array(normed), np.array(want))
    np.testing.assert_allclose(np.array(normed), np.array(mx.fast.rms_norm(want_h, w + offset, 1e-5)),
                               rtol=2e-6, atol=2e-6)


@needs_kernel
def test_add_rms_norm_in_place_strided_and_validation():
    x, residual, w = normal((24, 16), 11), normal((24, 16), 12), normal((16,), 13)
    # a fresh sum as x (donatable, its buffer becomes h) and a transposed view as the residual (copied)
    h, normed = kernel.add_rms_norm(x * 2, normal((16, 24), 14).T, w, eps=1e-6)
    want_h = normal((16, 24), 14).T + x * 2
    np.testing.assert_array_equal(np.array(h), np.array(want_h))
    np.testing.assert_array_equal(np.array(normed), np.array(kernel.rms_norm(want_h, w, eps=1e-6)))
    with pytest.raises(ValueError, match="one shape"):
        kernel.add_rms_norm(x, residual[:3], w, eps=1e-6)
    with pytest.raises(ValueError, match="float32"):
        kernel.add_rms_norm(x.astype(mx.float16), residual.astype(mx.float16), w, eps=1e-6)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_rms_norm_module_add_and_norm(dtype):
    """RMSNorm.add_and_norm is (residual + x, norm(residual + x)) on every backend and dtype."""
    norm = RMSNorm(64, eps=1e-5)
    norm.weight = normal((64,), 15).astype(dtype)
    x, residual = normal((5, 64), 16).astype(dtype), normal((5, 64), 17).astype(dtype)
    h, normed = norm.add_and_norm(x, residual)
    np.testing.assert_array_equal(np.array(h), np.array(residual + x))
    np.testing.assert_array_equal(np.array(normed), np.array(norm(residual + x)))
