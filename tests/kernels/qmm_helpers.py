"""A float stand-in for the quantized matmul kernels: the same packed weights (kernels/qmm.py),
dequantized and multiplied in float32, no int8 activations. Swapped in with `use_float_kernels`,
a model on the CPU kernel path must match the float reference to float32 rounding: this checks the
packing, fusing, output splits, GLU epilogue and embedding wiring apart from the kernels' int8
arithmetic (tested on its own in test_quantized_matmul.py)."""

from __future__ import annotations

from kernels import ext, qmm


def float_quantized_matmul(x, q, scales, biases, *, bits, group_size, columns, glu=-1, activation_bits=16,
                           bias_per_scale=0.0):
    if bias_per_scale:  # the kernels compute such biases from the scales: they must be exactly that
        assert qmm.symmetric_bias_per_scale(scales, biases, bits) == bias_per_scale
    return qmm.dequantized_matmul(x, q, scales, biases, bits=bits, columns=columns, glu=glu)


def float_quantized_rows(q, scales, biases, ids, *, bits, group_size, rows):
    return qmm.unpack(q, scales, biases, bits)[:rows][ids]


def use_float_kernels(monkeypatch) -> None:
    monkeypatch.setattr(ext, "quantized_matmul", float_quantized_matmul)
    monkeypatch.setattr(ext, "quantized_rows", float_quantized_rows)
