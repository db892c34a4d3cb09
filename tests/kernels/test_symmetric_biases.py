"""Symmetric weights (Q4_0, Q8_0: every bias exactly -2^(bits - 1) times its scale): the kernels compute the
biases from the scales instead of reading them (kernels/qmm.py: symmetric_bias_per_scale; QmmWeights::
bias_per_scale in kernels/csrc/kernel_table.h). Bit for bit what reading them gives, on every kernel set this
CPU runs, at token counts that take tile(), the avx512 GEMM and AVX2's unpacked panels, 4 and 8 bits, float16
and float32 scales, one and two outputs, and the MoE gather; where a set computes them its calls get zeroed
biases, so any path still reading them would fail. The detection says 0 where a single bias differs; a
non-finite factor is refused."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext, qmm
from tests.kernels.isa_helpers import evaluated_on

needs_kernel = pytest.mark.skipif(ext.load() is None, reason="kernels not built: python -m kernels.build")
# the kernel sets whose tiles (and the avx512 GEMM) compute the biases; scalar and the AMX tiles read them
COMPUTING_SETS = ("avx2", "avx512")


def biases_given(isa, biases):
    """What the factor's calls get as biases: zeros where the kernel set must not read them (so a path that
    still did would give other floats), the real ones elsewhere."""
    return mx.zeros_like(biases) if isa in COMPUTING_SETS else biases


def symmetric_packed(rng, n, k, bits, gs, scale_dtype):
    """Packed (q, scales, biases) of a random (n, k) weight whose biases are -2^(bits - 1) x its scales, as the
    loader writes Q4_0 / Q8_0 (w = d (q - 2^(bits - 1)))."""
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    q, scales, _ = mx.quantize(w, group_size=gs, bits=bits)
    scales = scales.astype(scale_dtype)
    biases = scales * -float(1 << (bits - 1))
    return qmm.pack(q, scales, biases, bits, gs, scale_dtype=scale_dtype)


@needs_kernel
@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 64), (8, 32)])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.float32])
@pytest.mark.parametrize("activation_bits", [8, 12])
def test_computed_biases_equal_read_ones(isa, bits, gs, scale_dtype, activation_bits):
    rng = np.random.default_rng(bits + gs + activation_bits)
    n, k = 48, 4 * gs * 4
    q, s, b = symmetric_packed(rng, 2 * n, k, bits, gs, scale_dtype)
    factor = qmm.symmetric_bias_per_scale(s, b, bits)
    assert factor == -float(1 << (bits - 1))
    for tokens in (1, 2, 3, 5, 8, 9, 16, 33):
        x = mx.array(rng.standard_normal((tokens, k)).astype(np.float32))
        for columns in ([2 * n], [n, n]):
            def both(x=x, columns=columns):
                kw = dict(bits=bits, group_size=gs, columns=columns, activation_bits=activation_bits)
                return (ext.quantized_matmul(x, q, s, b, **kw),
                        ext.quantized_matmul(x, q, s, biases_given(isa, b), bias_per_scale=factor, **kw))
            read, computed = evaluated_on(isa, both)
            for r, c in zip(read, computed):
                assert mx.array_equal(r, c).item(), (isa, tokens, columns)


@needs_kernel
def test_zeroed_biases_do_change_the_result():
    """The control for biases_given: without the factor, zeros in place of the biases give other floats, so
    the equality above shows the factor replaced them."""
    rng = np.random.default_rng(7)
    q, s, b = symmetric_packed(rng, 32, 256, 4, 32, mx.float16)
    x = mx.array(rng.standard_normal((1, 256)).astype(np.float32))
    kw = dict(bits=4, group_size=32, columns=[32], activation_bits=12)
    (want,) = ext.quantized_matmul(x, q, s, b, **kw)
    (without,) = ext.quantized_matmul(x, q, s, mx.zeros_like(b), **kw)
    assert not mx.array_equal(want, without).item()


def test_detection_needs_every_bias():
    rng = np.random.default_rng(3)
    scales = mx.array(rng.random((64, 8)).astype(np.float16))
    biases = scales * -8.0
    assert qmm.symmetric_bias_per_scale(scales, biases, 4) == -8.0
    assert qmm.symmetric_bias_per_scale(scales, scales * -128.0, 8) == -128.0
    assert qmm.symmetric_bias_per_scale(scales, biases, 8) == 0.0  # -8 s is not 8-bit symmetric
    one_off = np.array(biases)
    one_off[5, 3] = np.float16(one_off[5, 3] * 1.001 + 1e-3)
    assert qmm.symmetric_bias_per_scale(scales, mx.array(one_off), 4) == 0.0


@needs_kernel
@pytest.mark.parametrize("factor", [math.nan, math.inf])
def test_a_non_finite_factor_is_refused(factor):
    q, s, b = symmetric_packed(np.random.default_rng(1), 16, 64, 4, 32, mx.float16)
    with pytest.raises(ValueError, match="bias_per_scale"):
        ext.quantized_matmul(mx.ones((1, 64)), q, s, b, bits=4, group_size=32, columns=[16], bias_per_scale=factor)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_experts_computed_biases_equal_read_ones(isa, bits):
    """The MoE matmul (kernels/moe.py) runs the same tiles per expert: the factor changes no bit there either."""
    from kernels.moe import gather_quantized_matmul, pack_experts

    rng = np.random.default_rng(bits)
    experts, n, k, gs = 4, 48, 256, 32
    w = mx.array(rng.standard_normal((experts, n, k)).astype(np.float32))
    q, scales, _ = mx.quantize(w, group_size=gs, bits=bits)
    scales = scales.astype(mx.float16)
    q, s, b = pack_experts(q, scales, scales * -float(1 << (bits - 1)), bits, gs, mx.float16)
    factor = qmm.symmetric_bias_per_scale(s, b, bits)
    assert factor == -float(1 << (bits - 1))
    for tokens in (1, 3, 9, 20):
        x = mx.array(rng.standard_normal((tokens, k)).astype(np.float32))
        indices = mx.array(rng.integers(0, experts, size=(tokens, 2)).astype(np.int32))

        def both(x=x, indices=indices):
            kw = dict(bits=bits, group_size=gs, columns=n, activation_bits=12)
            return (gather_quantized_matmul(x, q, s, b, indices, **kw),
                    gather_quantized_matmul(x, q, s, biases_given(isa, b), indices, bias_per_scale=factor, **kw))
        read, computed = evaluated_on(isa, both)
        assert mx.array_equal(read, computed).item(), (isa, tokens)
