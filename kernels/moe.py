"""Mixture-of-experts layers computed straight from quantized expert weights on the CPU
(kernels/csrc/moe.cpp).

Each expert's affine weight (N, K) is packed as kernels/qmm.py packs one layer, and the experts are
stacked: q (E, P, 16 * K * bits / 8) uint8, scales / biases (E, P, K / group_size, 16). One call
takes the step's rows with their expert ids, groups the rows by expert (a counting sort in C++),
quantizes each row's activations once and runs the qmm micro-kernels over each used expert's panels:
no Python loop over experts, no dequantized copy of a weight.

    gather_quantized_matmul   x (T, K), indices (T, top_k) -> (T, top_k, N): row (t, j) times expert
                              indices[t, j]; with glu, act(gate) * up from (gate, up) panel pairs
    QuantizedSwitchGLUCPU     the experts' gate/up/down of an MoE block (mlx-lm's SwitchGLU):
                              x (T, D), indices (T, top_k) -> (T, top_k, D)
"""

from __future__ import annotations

from collections.abc import Sequence

from kernels import ext
from kernels.backend import activation_bits_for, matmul_activation_bits
from kernels.qmm import GLU_KINDS, _exact_in_float16, _precision, pack_layers, supports, symmetric_bias_per_scale
from kernels.runtime import mx, nn

__all__ = ["QuantizedSwitchGLUCPU", "gather_quantized_matmul", "has_moe_kernels", "pack_experts"]


def has_moe_kernels() -> bool:
    """True when the loaded extension has the MoE matmul (an older build lacks it: python -m kernels.build)."""
    return ext.has_qmm_kernels() and hasattr(ext.load(), "gather_quantized_matmul")


def pack_experts(weight: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int,
                 scale_dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """E experts' MLX affine weights (weight (E, N, K * bits / 32) uint32, scales / biases (E, N, K / g))
    -> (q (E, P, 16 * K * bits / 8) uint8, scales (E, P, K / g, 16), biases (same)), P = ceil(N / 16):
    the experts packed as layers in order (E x P panels, written once) and viewed per expert."""
    experts = weight.shape[0]
    q, s, b = pack_layers([(weight[e], scales[e], biases[e]) for e in range(experts)], bits, group_size,
                          scale_dtype=scale_dtype)
    return tuple(a.reshape(experts, -1, *a.shape[1:]) for a in (q, s, b))


def gather_quantized_matmul(x: mx.array, q: mx.array, scales: mx.array, biases: mx.array, indices: mx.array, *,
                            bits: int, group_size: int, columns: int, glu: int = -1,
                            activation_bits: int = 16, bias_per_scale: float = 0.0) -> mx.array:
    """x (T, K) float32, indices (T, top_k) or (T * top_k,) int in [0, E) -> (*indices.shape, columns)
    float32: row r times expert indices[r] (x row r // top_k). glu 0 / 1 (silu / gelu_tanh) fuses
    act(gate) * up over (gate, up) panel pairs. Needs has_moe_kernels()."""
    return ext._module().gather_quantized_matmul(
        x, q, scales, biases, indices, bits=int(bits), group_size=int(group_size), columns=int(columns),
        glu=int(glu), activation_bits=int(activation_bits), bias_per_scale=float(bias_per_scale),
    )


def _format(layers: Sequence[nn.Module]) -> tuple[int, int]:
    formats = {(layer.bits, layer.group_size) for layer in layers}
    if len(formats) != 1 or any(getattr(layer, "mode", "affine") != "affine" for layer in layers):
        raise ValueError(f"fused expert layers must share one affine format, got {sorted(formats)}")
    bits, group_size = formats.pop()
    if not supports(bits, group_size):
        raise ValueError(f"the CPU kernels do not compute {bits}-bit group {group_size} experts")
    return bits, group_size


def _scale_dtype(layers: Sequence[nn.Module]) -> mx.Dtype:
    exact = all(_exact_in_float16(layer.scales) and _exact_in_float16(layer.biases) for layer in layers)
    return mx.float16 if exact else mx.float32


class QuantizedSwitchGLUCPU(nn.Module):
    """The experts of an MoE block, down(act(gate(x)) * up(x)) per (token, expert) row, on the CPU kernels.

    Built from the quantized switch layers gate_proj, up_proj (E, I, D) and down_proj (E, D, I) in one
    affine format: gate and up are packed as (gate, up) panel pairs per expert, so the first call
    returns act(gate) * up directly; the second multiplies each row by its expert's down_proj."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, hidden_act: str,
                 activation_bits: int | None = None) -> None:
        super().__init__()
        if hidden_act not in GLU_KINDS:
            raise ValueError(f"expert activation {hidden_act!r} is not one of {sorted(GLU_KINDS)}")
        if any("bias" in layer for layer in (gate_proj, up_proj, down_proj)):
            raise ValueError("biased experts are not supported by the CPU MoE kernels")
        self.bits, self.group_size = _format([gate_proj, up_proj, down_proj])
        self.hidden_act = hidden_act
        self._glu = GLU_KINDS[hidden_act]
        self.activation_bits = matmul_activation_bits() if activation_bits is None else activation_bits
        self.num_experts, self.intermediate = gate_proj.weight.shape[0], gate_proj.weight.shape[1]
        self.dims = down_proj.weight.shape[1]
        scale_dtype = _scale_dtype([gate_proj, up_proj])
        gate = pack_experts(gate_proj.weight, gate_proj.scales, gate_proj.biases, self.bits, self.group_size,
                            scale_dtype)
        up = pack_experts(up_proj.weight, up_proj.scales, up_proj.biases, self.bits, self.group_size, scale_dtype)
        # (E, P, ...) each -> (E, P, 2, ...) -> (E, 2P, ...): gate panel 2p, up panel 2p + 1
        self.gate_up_q, self.gate_up_scales, self.gate_up_biases = (
            mx.contiguous(mx.stack([g, u], axis=2).reshape(g.shape[0], -1, *g.shape[2:])) for g, u in zip(gate, up)
        )
        self.down_q, self.down_scales, self.down_biases = pack_experts(
            down_proj.weight, down_proj.scales, down_proj.biases, self.bits, self.group_size,
            _scale_dtype([down_proj]),
        )
        # Q4_0 / Q8_0 experts: the tiles compute the biases (qmm.symmetric_bias_per_scale)
        self.gate_up_bias_per_scale = symmetric_bias_per_scale(self.gate_up_scales, self.gate_up_biases, self.bits)
        self.down_bias_per_scale = symmetric_bias_per_scale(self.down_scales, self.down_biases, self.bits)
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x (T, D), indices (T, top_k) int -> (T, top_k, D) in x's dtype."""
        dtype = x.dtype
        x32 = x if dtype == mx.float32 else x.astype(mx.float32)
        common = {"bits": self.bits, "group_size": self.group_size,
                  "activation_bits": activation_bits_for(self.activation_bits, x.shape[0])}
        hidden = gather_quantized_matmul(x32, self["gate_up_q"], self["gate_up_scales"], self["gate_up_biases"],
                                         indices, columns=self.intermediate, glu=self._glu,
                                         bias_per_scale=self.gate_up_bias_per_scale, **common)
        # hidden (T, top_k, I): row (t, j) is expert indices[t, j]'s, so down reads it one to one
        out = gather_quantized_matmul(hidden.reshape(-1, self.intermediate), self["down_q"], self["down_scales"],
                                      self["down_biases"], indices, columns=self.dims,
                                      bias_per_scale=self.down_bias_per_scale, **common)  # (T, top_k, D)
        return out if dtype == mx.float32 else out.astype(dtype)

    def _extra_repr(self) -> str:
        return (f"experts={self.num_experts}, dims={self.dims}, intermediate={self.intermediate}, bits={self.bits}, "
                f"group_size={self.group_size}, act={self.hidden_act}, "
                f"activations={_precision(self.activation_bits)}")
