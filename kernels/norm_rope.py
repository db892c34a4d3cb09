"""RMSNorm and RoPE as one graph node each on the CPU (kernels/csrc/norm_rope*).

MLX's CPU `mx.fast.rms_norm` and `mx.fast.rope` are decompositions into ~8 and ~25 graph nodes (its
fused kernels are GPU only). At one token per step the model's graph had ~3300 nodes for 30 layers,
most of them from these two, and MLX's dispatch costs a few microseconds per node whatever it
computes. The kernels compute the same float32 arithmetic in one node:

    RMSNorm      nn.RMSNorm's parameters; `weight_offset` 1 is gemma's x / rms(x) * (1 + w);
                 `add_and_norm` is a decoder's residual add and the norm after it in one node
    rope tables  cos / sin (T, head_dim / 2) of a step's positions, built once per step with MLX's
                 own ops in MLX's order (FlatRope caches them in the step's metadata)
    rope_qk      q and k rotated by the tables in one node

Chosen once at construction like the gated activations (kernels.backend.activation_backend,
METRALE_KERNELS): "kernel" on CPU with the extension built, for float32 inputs; everything else
(GPU, half types, the reference backend) runs MLX's fast ops.
"""

from __future__ import annotations

import math

from kernels import ext
from kernels.backend import activation_backend
from kernels.runtime import mx, nn

__all__ = ["RMSNorm", "rope_inv_frequencies", "rope_qk", "rope_tables"]


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same `weight`, same eps) through the fused kernel on CPU float32 inputs.
    Subclasses set `weight_offset` = 1 for a zero-centred weight (x / rms(x) * (1 + w))."""

    weight_offset = 0.0

    def __init__(self, dims: int, eps: float = 1e-5) -> None:
        super().__init__(dims, eps=eps)
        self._kernel = activation_backend() == "kernel"
        self._fused_add = self._kernel and hasattr(ext.load(), "add_rms_norm")  # an older build lacks it

    def __call__(self, x: mx.array) -> mx.array:
        """x (..., dims) -> (..., dims)."""
        weight = self["weight"]
        if self._kernel and x.dtype == mx.float32 and weight.dtype == mx.float32:
            return ext.load().rms_norm(x, weight, eps=self.eps, weight_offset=self.weight_offset)
        if self.weight_offset:
            weight = self.weight_offset + weight
        return mx.fast.rms_norm(x, weight, self.eps)

    def add_and_norm(self, x: mx.array, residual: mx.array) -> tuple[mx.array, mx.array]:
        """x, residual (..., dims) -> (h, self(h)) with h = residual + x: a decoder's residual add and the
        norm after it, one node on CPU float32 (the same bits as the two ops), else the two ops."""
        weight = self["weight"]
        if (self._fused_add and x.dtype == mx.float32 and residual.dtype == mx.float32 and weight.dtype == mx.float32
                and x.shape == residual.shape):
            h, normed = ext.load().add_rms_norm(x, residual, weight, eps=self.eps, weight_offset=self.weight_offset)
            return h, normed
        h = residual + x
        return h, self(h)


def rope_inv_frequencies(dims: int, base: float | None, freqs: mx.array | None) -> mx.array:
    """Angular frequency per rotated pair (dims / 2,) float32, as mx.fast.rope computes it on CPU:
    exp(-i * log(base) / (dims / 2)), or 1 / freqs when the model gives wavelength divisors."""
    if freqs is not None:
        return mx.reciprocal(freqs.astype(mx.float32))
    half = dims // 2
    coefficient = mx.array(math.log(base) / half, dtype=mx.float32)
    return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * coefficient)  # (dims / 2,)


def rope_tables(positions: mx.array, inv_frequencies: mx.array, scale: float) -> tuple[mx.array, mx.array]:
    """positions (T,) int -> (cos, sin), each (T, dims / 2) float32: theta = positions * scale * inv_freq."""
    theta = (positions.astype(mx.float32) * scale)[:, None] * inv_frequencies[None, :]  # (T, dims / 2)
    return mx.cos(theta), mx.sin(theta)


def rope_qk(q: mx.array, k: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> tuple[mx.array, mx.array]:
    """q (T, Hq, D), k (T, Hk, D) float32 rotated by cos / sin (T, D / 2) in one node (needs the kernel)."""
    q_out, k_out = ext.load().rope_qk(q, k, cos, sin, traditional=traditional)
    return q_out, k_out
