"""A float stand-in for the quantized matmul kernels: the same packed weights (kernels/qmm.py),
dequantized and multiplied in float32, no int8 activations. Swapped in with `use_float_kernels`,
a model on the CPU kernel path must match the float reference to float32 rounding: this checks the
packing, fusing, output splits, GLU epilogue and embedding wiring apart from the kernels' int8
arithmetic (tested on its own in test_quantized_matmul.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels import ext, qmm

PANEL = qmm.PANEL
_ACTS = {0: nn.silu, 1: nn.gelu_approx}


def float_quantized_matmul(x, q, scales, biases, *, bits, group_size, columns, glu=-1, activation_bits=16):
    w = qmm.unpack(q, scales, biases, bits)  # (P * 16, K)
    if glu >= 0:
        pairs = w.reshape(-1, 2, PANEL, w.shape[1])  # (P / 2, [gate, up], 16, K)
        gate = pairs[:, 0].reshape(-1, w.shape[1])[: columns[0]]
        up = pairs[:, 1].reshape(-1, w.shape[1])[: columns[0]]
        return [_ACTS[glu](x @ gate.T) * (x @ up.T)]
    outs, row = [], 0
    for c in columns:
        outs.append(x @ w[row : row + c].T)
        row += -(-c // PANEL) * PANEL
    return outs


def float_quantized_rows(q, scales, biases, ids, *, bits, group_size, rows):
    return qmm.unpack(q, scales, biases, bits)[:rows][ids]


def use_float_kernels(monkeypatch) -> None:
    monkeypatch.setattr(ext, "quantized_matmul", float_quantized_matmul)
    monkeypatch.setattr(ext, "quantized_rows", float_quantized_rows)
