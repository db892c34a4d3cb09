"""Linear layers computed straight from 4- and 8-bit affine weights on the CPU (kernels/csrc/qmm*).

MLX's affine format: w[n, k] = q[n, k] * scale[n, g] + bias[n, g] for the group g = k // group_size,
q unsigned (4 or 8 bits) packed into uint32, scales and biases (N, K / group_size). At load the
weights are repacked once into the layout the kernels read (kernels/csrc/kernel_table.h):

    panel p = rows 16p .. 16p + 15 (the last one zero-padded), K / 4 (8 bits) or K / 8 (4 bits)
    chunks of 64 bytes: lane r (4 bytes) = row 16p + r, 4 consecutive k (4 bits: low nibbles k..k+3,
    high nibbles k+4..k+7); scales and biases (P, K / group_size, 16) float16 when exact, else float32

Several layers that read the same input can share one packed weight (q/k/v; gate/up): one call,
one quantization of the activations, one output per layer. With `glu` the gate and up panels
alternate and the kernel returns act(gate) * up directly.

    QuantizedLinearCPU      one or more fused nn.QuantizedLinear; __call__(x (..., K)) -> (..., N) (or a tuple)
    QuantizedEmbeddingCPU   an nn.QuantizedEmbedding: lookups dequantize only the looked-up rows;
                            as_linear (the tied lm_head) runs the matmul kernel

From BLAS_CROSSOVER rows on (kernel sets where it was measured faster: not avx512), a call
dequantizes its weight to float32 and runs BLAS instead (`dequantized_matmul`); such rows then
carry float32 rounding instead of the kernels' (a batch crossing the threshold changes them slightly).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kernels import ext
from kernels.backend import activation_bits_for, matmul_activation_bits
from kernels.runtime import mx, nn

__all__ = [
    "GLU_KINDS", "QuantizedEmbeddingCPU", "QuantizedLinearCPU", "SUPPORTED", "mlx_ints", "pack", "pack_layers", "supports",
    "unpack",
]

PANEL = 16
SUPPORTED = {"bits": (4, 8), "group_size": (32, 64, 128)}
GLU_KINDS = {"silu": 0, "gelu_pytorch_tanh": 1}  # hidden_act -> the kernel's epilogue


def supports(bits: int, group_size: int) -> bool:
    """True when the kernels compute this affine format."""
    return bits in SUPPORTED["bits"] and group_size in SUPPORTED["group_size"]


def _exact_in_float16(a: mx.array) -> bool:
    a32 = a.astype(mx.float32)
    return bool(mx.array_equal(a32.astype(mx.float16).astype(mx.float32), a32))


def mlx_ints(packed: mx.array, bits: int) -> mx.array:
    """MLX-packed uint32 (N, K * bits / 32) -> q uint8 (N, K). Element i of a word sits at bits
    i*b .. i*b + b - 1, so on a little-endian host its bytes are the elements in order."""
    if sys.byteorder != "little":
        raise RuntimeError("the quantized CPU kernels need a little-endian host")
    as_bytes = packed.view(mx.uint8)  # (N, K * bits / 8)
    if bits == 8:
        return as_bytes
    lo, hi = as_bytes & 15, as_bytes >> 4  # elements 2j and 2j + 1
    return mx.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)  # (N, K)


PLACE_ON_HUGE_PAGES = True  # packed weights on 2 MiB pages where the OS allows (benchmarks turn it off for A/B)


def pack(packed: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int,
         scale_dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """One MLX affine weight (packed (N, K * bits / 32) uint32, scales / biases (N, K / group_size))
    -> (q (P, 16 * K * bits / 8) uint8, scales (P, K / group_size, 16), biases (same)), P = ceil(N / 16).

    scale_dtype: float16 or float32; None takes float16 when every scale and bias is exactly a
    float16 (GGUF's always are), else float32. ValueError for a format the kernels do not compute."""
    return pack_layers([(packed, scales, biases)], bits, group_size, scale_dtype=scale_dtype)


def pack_layers(weights: Sequence[tuple[mx.array, mx.array, mx.array]], bits: int, group_size: int, *,
                glu: bool = False, scale_dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """Several (packed, scales, biases) MLX affine weights of one K as one packed weight: their panels in
    order, or with glu exactly [gate, up] with gate panel p at 2p and up panel p at 2p + 1. scale_dtype as
    `pack`'s (None: float16 when every layer's scales and biases are exact in it).

    `ext.pack_panels` (needs the kernels built, as every user of the layout does) writes the layout straight
    into its final buffers (on huge pages where the OS allows and PLACE_ON_HUGE_PAGES): packing a weight of B
    bytes needs B more bytes. The MLX ops of `_pack_mlx` (the reference the tests hold it to) need several
    times that in intermediates: the 3B shape's tied embedding raised the loader's peak RSS by ~0.9 GiB."""
    if not supports(bits, group_size):
        raise ValueError(f"the CPU kernels compute bits {SUPPORTED['bits']} x group sizes "
                         f"{SUPPORTED['group_size']}, not bits {bits}, group size {group_size}")
    if glu and len(weights) != 2:
        raise ValueError(f"glu packs exactly [gate, up], got {len(weights)} weights")
    for packed, scales, biases in weights:
        n, k = packed.shape[0], packed.shape[1] * 32 // bits
        if scales.shape != (n, k // group_size) or biases.shape != scales.shape:
            raise ValueError(f"scales {tuple(scales.shape)} and biases {tuple(biases.shape)} must be "
                             f"({n}, {k // group_size}) for packed {tuple(packed.shape)} at {bits} bits")
    if scale_dtype is None:
        exact = all(_exact_in_float16(s) and _exact_in_float16(b) for _, s, b in weights)
        scale_dtype = mx.float16 if exact else mx.float32
    q, s, b = ext.pack_panels([w[0] for w in weights], [w[1].astype(scale_dtype) for w in weights],
                              [w[2].astype(scale_dtype) for w in weights], bits=bits, group_size=group_size,
                              interleave=glu, huge_pages=PLACE_ON_HUGE_PAGES)
    return q, s, b


def _pack_mlx(packed: mx.array, scales: mx.array, biases: mx.array, bits: int,
              scale_dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """`pack` in MLX ops (lazy): the layout's reference, which tests/kernels/test_pack_panels.py holds
    ext.pack_panels to byte for byte."""
    n, k = packed.shape[0], packed.shape[1] * 32 // bits
    panels = -(-n // PANEL)
    pad = panels * PANEL - n
    q = mlx_ints(packed, bits)  # (N, K)
    s, b = scales.astype(scale_dtype), biases.astype(scale_dtype)  # (N, K / g)
    if pad:
        q = mx.concatenate([q, mx.zeros((pad, k), dtype=mx.uint8)])
        s = mx.concatenate([s, mx.zeros((pad, s.shape[1]), dtype=scale_dtype)])
        b = mx.concatenate([b, mx.zeros((pad, b.shape[1]), dtype=scale_dtype)])
    if bits == 8:
        q = q.reshape(panels, PANEL, k // 4, 4).transpose(0, 2, 1, 3)  # (P, K / 4, 16, 4)
    else:
        q = q.reshape(panels, PANEL, k // 8, 2, 4).transpose(0, 2, 1, 4, 3)  # (P, K / 8, 16, 4, [lo, hi])
        q = q[..., 0] | (q[..., 1] << 4)  # (P, K / 8, 16, 4)
    s = s.reshape(panels, PANEL, -1).transpose(0, 2, 1)  # (P, K / g, 16)
    b = b.reshape(panels, PANEL, -1).transpose(0, 2, 1)  # (P, K / g, 16)
    return mx.contiguous(q.reshape(panels, -1)), mx.contiguous(s), mx.contiguous(b)


def unpack(q: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """The inverse of `pack`, dequantized: (P * 16, K) float32, every panel row (padding included).
    For tests and debugging: the kernels never materialize it."""
    panels = q.shape[0]
    k = q.shape[1] * 8 // (PANEL * bits)
    if bits == 8:
        ints = q.reshape(panels, k // 4, PANEL, 4).transpose(0, 2, 1, 3)  # (P, 16, K / 4, 4)
    else:
        nibbles = q.reshape(panels, k // 8, PANEL, 4)  # (P, K / 8, 16, 4)
        ints = mx.stack([nibbles & 15, nibbles >> 4], axis=-1)  # (P, K / 8, 16, 4, [lo, hi])
        ints = ints.transpose(0, 2, 1, 4, 3)  # (P, 16, K / 8, 2, 4)
    groups = scales.shape[1]
    ints = ints.reshape(panels * PANEL, groups, k // groups).astype(mx.float32)  # (P * 16, K / g, g)
    s = scales.astype(mx.float32).transpose(0, 2, 1).reshape(panels * PANEL, groups, 1)  # (P * 16, K / g, 1)
    b = biases.astype(mx.float32).transpose(0, 2, 1).reshape(panels * PANEL, groups, 1)
    return (ints * s + b).reshape(panels * PANEL, k)  # (P * 16, K)


# Token rows from which float32 BLAS on weights dequantized per call beats the kernels, per kernel set.
# avx512: never (1.15x the kernel's time at 512 rows; one core, int16, Zen 4). avx2: never. On an AVX2-only
# Zen 3 (2 threads, int12, idle, benchmarks/results/s8_blas_crossover_avx2.txt) BLAS takes 18-35x the kernel's
# time at 16 rows, 3.0-5.7x at 128 and 1.3-1.7x at 512 on the 1B shapes (7-11x / 1.2-2.2x / 0.68-1.36x on the
# 135M ones): a crossover would win only at 512 rows of the smallest matrix, and would make a row's value depend on the
# size of its call (an earlier crossover at 16, measured on a Zen 4 whose BLAS used AVX-512, did both).
# scalar: 0.62x at 2 rows.
BLAS_CROSSOVER = {"avx512": None, "avx2": None, "scalar": 2}


def symmetric_bias_per_scale(scales: mx.array, biases: mx.array, bits: int) -> float:
    """-2^(bits - 1) where every bias is exactly that times its scale, in float32 as the kernels compute it (the
    symmetric formats, Q4_0 and Q8_0, as the loader writes them: w = d (q - 8) = d q - 8 d), else 0.0. Where
    it is nonzero the AVX2 / AVX-512 kernels compute the biases from the scales instead of reading them (2 of
    the 20 bytes per 32 4-bit weights a decode step streams); the biases are kept for the other kernel sets."""
    factor = -float(1 << (bits - 1))
    same = mx.all(biases.astype(mx.float32) == scales.astype(mx.float32) * factor)
    return factor if bool(same.item()) else 0.0


def blas_crossover() -> int | None:
    """Rows from which the running kernel set hands a quantized linear to float32 BLAS (None: never)."""
    return BLAS_CROSSOVER.get(ext.cpu_isa() or "", None)


def dequantized_matmul(x: mx.array, q: mx.array, scales: mx.array, biases: mx.array, *, bits: int,
                       columns: Sequence[int], glu: int = -1) -> list[mx.array]:
    """What the kernel computes, in float32 from the packed weight dequantized for this call: x (..., K)
    -> one (..., columns[j]) per output; glu 0 / 1 (silu / gelu_tanh) over (gate, up) panel pairs.
    The path for many rows where BLAS is faster (BLAS_CROSSOVER), and the tests' float reference."""
    w = unpack(q, scales, biases, bits)  # (P * 16, K) float32
    if glu >= 0:
        pairs = w.reshape(-1, 2, PANEL, w.shape[1])  # (P / 2, [gate, up], 16, K)
        gate = pairs[:, 0].reshape(-1, w.shape[1])[: columns[0]]  # (N, K)
        up = pairs[:, 1].reshape(-1, w.shape[1])[: columns[0]]
        act = nn.silu if glu == GLU_KINDS["silu"] else nn.gelu_approx
        return [act(x @ gate.T) * (x @ up.T)]
    outs, row = [], 0
    for c in columns:
        outs.append(x @ w[row : row + c].T)  # (..., c)
        row += -(-c // PANEL) * PANEL
    return outs


def _format(layers: Sequence[nn.Module]) -> tuple[int, int]:
    formats = {(layer.bits, layer.group_size) for layer in layers}
    if len(formats) != 1:
        raise ValueError(f"fused layers must share bits and group size, got {sorted(formats)}")
    if any(getattr(layer, "mode", "affine") != "affine" for layer in layers):
        raise ValueError("only affine quantization is supported")
    return formats.pop()


def _precision(activation_bits: int) -> str:
    return f"int{activation_bits}" if activation_bits else "auto"


class QuantizedLinearCPU(nn.Module):
    """One or more quantized linear layers of the same input, computed by the CPU kernels.

    `from_layers([q_proj, k_proj, v_proj])` returns (q, k, v) from one call; `from_layers([gate,
    up], glu="silu")` returns act(gate(x)) * up(x). x (..., K) float32 (other float dtypes are
    computed in float32 and cast back)."""

    def __init__(self, q: mx.array, scales: mx.array, biases: mx.array, *, bits: int, group_size: int,
                 columns: Sequence[int], glu: str | None = None,
                 bias: Sequence[mx.array | None] | None = None, activation_bits: int | None = None) -> None:
        super().__init__()
        # packed (see module docstring) by `pack` / `pack_layers`, which put them on huge pages where the OS
        # allows: a one-token step streams them whole
        self.q, self.scales, self.biases = q, scales, biases
        self.bits, self.group_size = bits, group_size
        self.activation_bits = matmul_activation_bits() if activation_bits is None else activation_bits
        self.columns = tuple(int(c) for c in columns)
        self.glu = glu
        self._glu_code = -1 if glu is None else GLU_KINDS[glu]
        self.in_features = scales.shape[1] * group_size
        self.bias_per_scale = symmetric_bias_per_scale(scales, biases, bits)
        self.blas_rows = blas_crossover()  # from this many rows: dequantize per call, float32 BLAS
        if bias is not None and any(b is not None for b in bias):
            self.bias = [b if b is not None else mx.zeros((c,)) for b, c in zip(bias, self.columns)]
        self.freeze()

    @classmethod
    def from_layers(cls, layers: Sequence[nn.Module], glu: str | None = None) -> "QuantizedLinearCPU":
        """Fuse nn.QuantizedLinear `layers` (same input, bits and group size; with `glu` exactly
        [gate, up] of the same size, hidden_act a key of GLU_KINDS)."""
        bits, group_size = _format(layers)
        if glu is not None and (glu not in GLU_KINDS or len(layers) != 2
                                or layers[0].weight.shape != layers[1].weight.shape):
            raise ValueError(f"glu {glu!r} needs [gate, up] of one shape and an act in {sorted(GLU_KINDS)}")
        q, s, b = pack_layers([(layer.weight, layer.scales, layer.biases) for layer in layers], bits, group_size,
                              glu=glu is not None)
        columns = [layers[0].weight.shape[0]] if glu else [layer.weight.shape[0] for layer in layers]
        bias = None
        if any("bias" in layer for layer in layers):
            if glu is not None:
                raise ValueError("a fused gate/up takes no bias")
            bias = [layer["bias"] if "bias" in layer else None for layer in layers]
        return cls(q, s, b, bits=bits, group_size=group_size, columns=columns, glu=glu, bias=bias)

    def __call__(self, x: mx.array) -> mx.array | tuple[mx.array, ...]:
        """x (..., K) -> (..., N) for one output, else a tuple of (..., N_j)."""
        # the hot path of a decode step (~120 calls): dict reads, no attribute lookups through nn.Module
        dtype = x.dtype
        x32 = x if dtype == mx.float32 else x.astype(mx.float32)
        if self.blas_rows is not None and x.size >= self.blas_rows * self.in_features:
            outs = dequantized_matmul(x32, self["q"], self["scales"], self["biases"], bits=self.bits,
                                      columns=self.columns, glu=self._glu_code)
        else:
            bits = activation_bits_for(self.activation_bits, x.size // self.in_features)
            outs = ext.quantized_matmul(x32, self["q"], self["scales"], self["biases"], bits=self.bits,
                                        group_size=self.group_size, columns=self.columns, glu=self._glu_code,
                                        activation_bits=bits, bias_per_scale=self.bias_per_scale)
        bias = self.get("bias")
        if bias is not None:
            outs = [o + b for o, b in zip(outs, bias)]
        if dtype != mx.float32:
            outs = [o.astype(dtype) for o in outs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _extra_repr(self) -> str:
        glu = f", glu={self.glu}" if self.glu else ""
        return (f"in={self.in_features}, out={self.columns}, bits={self.bits}, group_size={self.group_size}{glu}, "
                f"activations={_precision(self.activation_bits)}")


class QuantizedEmbeddingCPU(nn.Module):
    """An nn.QuantizedEmbedding repacked for the CPU kernels: `__call__(ids)` dequantizes the
    looked-up rows only; `as_linear(x)` is x @ W^T by the matmul kernel (the tied lm_head)."""

    def __init__(self, embedding: nn.Module, activation_bits: int | None = None) -> None:
        super().__init__()
        self.bits, self.group_size = _format([embedding])
        self.activation_bits = matmul_activation_bits() if activation_bits is None else activation_bits
        self.blas_rows = blas_crossover()
        self.num_embeddings = embedding.weight.shape[0]
        # as QuantizedLinearCPU's (on huge pages where allowed)
        self.q, self.scales, self.biases = pack(embedding.weight, embedding.scales, embedding.biases, self.bits,
                                                self.group_size)
        self.dims = self.scales.shape[1] * self.group_size
        self.bias_per_scale = symmetric_bias_per_scale(self.scales, self.biases, self.bits)
        self.freeze()

    def __call__(self, ids: mx.array) -> mx.array:
        """ids (...) int -> (..., dims) float32."""
        return ext.quantized_rows(self.q, self.scales, self.biases, ids, bits=self.bits,
                                  group_size=self.group_size, rows=self.num_embeddings)

    def as_linear(self, x: mx.array) -> mx.array:
        """x (..., dims) -> (..., num_embeddings) float32."""
        x32 = x if x.dtype == mx.float32 else x.astype(mx.float32)
        if self.blas_rows is not None and x.size >= self.blas_rows * self.dims:
            (out,) = dequantized_matmul(x32, self.q, self.scales, self.biases, bits=self.bits,
                                        columns=[self.num_embeddings])
        else:
            (out,) = ext.quantized_matmul(x32, self.q, self.scales, self.biases, bits=self.bits,
                                          group_size=self.group_size, columns=[self.num_embeddings],
                                          activation_bits=activation_bits_for(self.activation_bits,
                                                                              x.size // self.dims),
                                          bias_per_scale=self.bias_per_scale)
        return out

    def _extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.dims}, bits={self.bits}, group_size={self.group_size}, "
                f"activations={_precision(self.activation_bits)}")
