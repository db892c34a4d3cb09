"""Gated MLP activations, act(gate) * up, fused on the CPU (SwiGLU, GeGLU).

    kind                 models                      reference (plain MLX)
    "silu"               Llama, Qwen, SmolLM, ...    nn.silu(gate) * up
    "gelu_pytorch_tanh"  Gemma                       nn.gelu_approx(gate) * up
    "gelu"               exact (erf) GELU            nn.gelu(gate) * up

Two implementations, chosen by kernels.backend.activation_backend() (METRALE_KERNELS):
  reference  the plain MLX expression; every device, dtype and kind.
  kernel     the extension's silu_mul / gelu_tanh_mul (C++, CPU): one vectorized pass over gate and
             up. MLX's CPU exp is scalar on x86 Linux (~20 ns per element), which made the SwiGLU of
             a (32, 1536) decode step cost as much as the MLP matmuls.
Inputs the kernel does not take run the reference even on the kernel backend: kind "gelu" (no erf
kernel), gate and up of different dtypes (MLX's promotion applies), dtypes other than float32,
float16 and bfloat16. Inference only: the kernel defines no vjp / vmap (grad raises).

A model resolves its function once, at construction (`gated_activation_fn`); `gated_activation`
decides on every call (tests, benchmarks).
"""

from __future__ import annotations

from collections.abc import Callable

from kernels import ext
from kernels.backend import activation_backend
from kernels.runtime import mx, nn

__all__ = ["KINDS", "gated_activation", "gated_activation_fn"]

KINDS = ("silu", "gelu_pytorch_tanh", "gelu")
_KERNEL_OPS = {"silu": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul"}  # kind -> extension function
_KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_REFERENCE = {
    "silu": lambda gate, up: nn.silu(gate) * up,
    "gelu_pytorch_tanh": lambda gate, up: nn.gelu_approx(gate) * up,
    "gelu": lambda gate, up: nn.gelu(gate) * up,
}

GatedActivation = Callable[[mx.array, mx.array], mx.array]


def gated_activation_fn(kind: str, backend: str | None = None) -> GatedActivation:
    """act(gate) * up for `kind` on `backend` ("kernel" | "reference"; None: activation_backend()).

    The returned function takes gate and up of the same shape (..., intermediate) (ValueError
    otherwise) and returns that shape; the dtype is gate's when both share it, else MLX's promotion.
    """
    if kind not in _REFERENCE:
        raise ValueError(f"unknown gated activation {kind!r}: expected one of {', '.join(KINDS)}")
    backend = activation_backend() if backend is None else backend
    reference = _REFERENCE[kind]
    op = _KERNEL_OPS.get(kind) if backend == "kernel" else None

    def gated(gate: mx.array, up: mx.array) -> mx.array:
        if gate.shape != up.shape:
            raise ValueError(f"gated_activation: gate {gate.shape} and up {up.shape} must have the same shape")
        if op is not None and gate.dtype == up.dtype and gate.dtype in _KERNEL_DTYPES:
            return getattr(ext.load(), op)(gate, up)
        return reference(gate, up)

    return gated


def gated_activation(gate: mx.array, up: mx.array, kind: str) -> mx.array:
    """act(gate) * up, deciding the backend now (see `gated_activation_fn` for the contract)."""
    if kind not in _REFERENCE:
        raise ValueError(f"unknown gated activation {kind!r}: expected one of {', '.join(KINDS)}")
    backend = activation_backend()  # validates METRALE_KERNELS whatever the kind
    return gated_activation_fn(kind, backend)(gate, up)
