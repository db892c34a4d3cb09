"""The MoE gathered quantized matmul (kernels/csrc/moe.cpp, kernels/moe.py) against plain MLX's
mx.gather_qmm and against the dense quantized matmul kernel expert by expert, for every format and
instruction set; the experts module against the plain-MLX SwitchGLU on the same quantized weights.

Tolerances: the same rows through quantized_matmul (one expert's packed weight) give bit-identical
results (the same micro-kernels, the same activation quantization); against mx.gather_qmm (float32
activations) the bound of test_quantized_matmul.quantization_bound per element."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import ext
from kernels.moe import QuantizedSwitchGLUCPU, gather_quantized_matmul, has_moe_kernels, pack_experts
from tests.kernels.test_quantized_matmul import FORMATS, quantization_bound

pytestmark = pytest.mark.skipif(ext.load() is None or not has_moe_kernels(),
                                reason="kernels not built: python -m kernels.build")


def experts(rng, e, n, k, bits, gs):
    """(MLX triple (E, N, ...), dequantized (E, N, K) numpy, packed (q, scales, biases))."""
    w = mx.array(rng.standard_normal((e, n, k)).astype(np.float32))
    triple = mx.quantize(w, group_size=gs, bits=bits)
    dequantized = np.array(mx.dequantize(*triple, group_size=gs, bits=bits))
    return triple, dequantized, pack_experts(*triple, bits, gs, mx.float32)


@pytest.mark.parametrize("bits,gs", FORMATS)
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (1, 4), (3, 2), (17, 4), (70, 2)])
def test_matches_gather_qmm_within_the_activation_bound(isa, bits, gs, tokens, top_k):
    rng = np.random.default_rng(tokens * 10 + top_k)
    e, n, k = 6, 40, 128
    triple, dequantized, packed = experts(rng, e, n, k, bits, gs)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    idx = rng.integers(0, e, (tokens, top_k)).astype(np.int32)
    got = np.array(gather_quantized_matmul(mx.array(x), *packed, mx.array(idx), bits=bits, group_size=gs, columns=n))
    assert got.shape == (tokens, top_k, n)
    want = np.array(mx.gather_qmm(mx.expand_dims(mx.array(x), (-2, -3)), *triple, rhs_indices=mx.array(idx),
                                  transpose=True, group_size=gs, bits=bits)).squeeze(-2)  # (T, top_k, N)
    for t in range(tokens):
        for j in range(top_k):
            bound = quantization_bound(x[t : t + 1], dequantized[idx[t, j]])[0]  # (N,)
            assert (np.abs(got[t, j] - want[t, j]) <= bound + 1e-4 * np.abs(want[t, j])).all(), (t, j)


@pytest.mark.parametrize("bits,gs", [(4, 32), (8, 64)])
@pytest.mark.parametrize("glu", [-1, 0, 1])
@pytest.mark.parametrize("activation_bits", [8, 12, 16])
def test_each_expert_equals_the_dense_kernel_on_its_weight(isa, bits, gs, glu, activation_bits):
    """Rows grouped by expert run exactly what quantized_matmul runs on that expert's packed weight."""
    rng = np.random.default_rng(7)
    e, n, k, tokens = 5, 24, 64, 13
    w = mx.array(rng.standard_normal((e, 2 * n if glu >= 0 else n, k)).astype(np.float32))
    triple = mx.quantize(w, group_size=gs, bits=bits)
    q, s, b = pack_experts(*triple, bits, gs, mx.float32)
    if glu >= 0:  # (gate, up) panel pairs per expert, as QuantizedSwitchGLUCPU packs them
        gate = pack_experts(*(a[:, :n] for a in triple), bits, gs, mx.float32)
        up = pack_experts(*(a[:, n:] for a in triple), bits, gs, mx.float32)
        q, s, b = (mx.stack([g, u], axis=2).reshape(e, -1, *g.shape[2:]) for g, u in zip(gate, up))
    x = mx.array(rng.standard_normal((tokens, k)).astype(np.float32))
    idx = mx.array(rng.integers(0, e, (tokens,)).astype(np.int32))
    got = gather_quantized_matmul(x, q, s, b, idx, bits=bits, group_size=gs, columns=n, glu=glu,
                                  activation_bits=activation_bits)  # (T, N)
    for t in range(tokens):
        ex = int(idx[t].item())
        (want,) = ext.quantized_matmul(x[t : t + 1], q[ex], s[ex], b[ex], bits=bits, group_size=gs, columns=[n],
                                       glu=glu, activation_bits=activation_bits)
        assert mx.array_equal(got[t : t + 1], want).item(), (t, ex)


def test_many_rows_use_threads_and_no_rows_is_empty(isa):
    rng = np.random.default_rng(3)
    e, n, k = 8, 256, 512
    triple, _, packed = experts(rng, e, n, k, 4, 32)
    x = mx.array(rng.standard_normal((96, k)).astype(np.float32))
    idx = mx.array(rng.integers(0, e, (96, 4)).astype(np.int32))
    got = gather_quantized_matmul(x, *packed, idx, bits=4, group_size=32, columns=n)
    want = mx.gather_qmm(mx.expand_dims(x, (-2, -3)), *triple, rhs_indices=idx, transpose=True, group_size=32,
                         bits=4).squeeze(-2)
    assert mx.abs(got - want).max().item() < 1e-2 * mx.abs(want).max().item()
    empty = gather_quantized_matmul(mx.zeros((0, k)), *packed, mx.zeros((0, 2), dtype=mx.int32), bits=4,
                                    group_size=32, columns=n)
    assert empty.shape == (0, 2, n)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"bits": 3}, "bits must be 4 or 8"),
        ({"columns": 17}, "columns do not fit"),
        ({"x": mx.zeros((3, 64))}, r"x must be \(..., K=128\)"),
        ({"indices": mx.zeros((4,), dtype=mx.int32)}, "whole number of rows per token"),
        ({"indices": mx.zeros((3,), dtype=mx.float32)}, "indices must be integers"),
        ({"glu": 2}, "glu must be"),
    ],
)
def test_validates_inputs(change, match):
    rng = np.random.default_rng(0)
    _, _, (q, s, b) = experts(rng, 2, 16, 128, 4, 32)
    args = {"x": mx.zeros((3, 128)), "indices": mx.zeros((3, 2), dtype=mx.int32), "bits": 4, "columns": 16,
            "glu": -1, **change}
    with pytest.raises(ValueError, match=match):
        gather_quantized_matmul(args["x"], q, s, b, args["indices"], bits=args["bits"], group_size=32,
                                columns=args["columns"], glu=args["glu"])


def test_switch_glu_module_matches_the_plain_mlx_experts(isa):
    """QuantizedSwitchGLUCPU (gate/up fused, then down) against metrale.models.moe's plain-MLX SwitchGLU
    (mx.gather_qmm) on the same quantized experts."""
    from metrale.models.moe import SwitchGLU

    mx.random.seed(0)
    plain = SwitchGLU(64, 96, 6, "silu")
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(plain, name, getattr(plain, name).to_quantized(group_size=32, bits=8))
    x = mx.random.normal((40, 64))
    idx = mx.random.randint(0, 6, (40, 2)).astype(mx.int32)
    want = plain(x, idx)  # (T, top_k, D); 80 rows: the sorted path
    # int16 activations: float32 noise; int12: 16x finer than int8; auto takes int8 for these 40 tokens: int8 noise
    for bits, tol in ((16, 1e-3), (12, 4e-3), (0, 2e-2)):
        fused = QuantizedSwitchGLUCPU(plain.gate_proj, plain.up_proj, plain.down_proj, hidden_act="silu",
                                      activation_bits=bits)
        got = fused(x, idx)
        assert got.shape == want.shape == (40, 2, 64)
        assert mx.abs(got - want).max().item() < tol * mx.abs(want).max().item(), bits
