"""Gated MLP activations, act(gate) * up, fused on the CPU (SwiGLU, GeGLU).

    kind                 models                      reference (plain MLX)
    "silu"               Llama, Qwen, SmolLM, ...    nn.silu(gate) * up
    "gelu_pytorch_tanh"  Gemma                       nn.gelu_approx(gate) * up
    "gelu"               exact (erf) GELU            nn.gelu(gate) * up

Two paths behind `gated_activation`, chosen by activation_backend() (METRALE_KERNELS, the same
auto/kernel/reference values as METRALE_ATTENTION in kvcache.attention):
  reference  the plain MLX expression; every device, dtype and kind.
  kernel     kvcache/_ext silu_mul / gelu_tanh_mul (C++, CPU, optional build): one vectorized pass
             over gate and up. MLX's CPU exp is scalar on x86 Linux (~20 ns per element), which made
             the SwiGLU of a (32, 1536) decode step cost as much as the MLP matmuls.
Inputs the kernel does not take run the reference even on the kernel backend: kind "gelu" (no erf
kernel), gate and up of different dtypes (MLX's promotion applies), dtypes other than float32,
float16 and bfloat16. Inference only: the kernel defines no vjp / vmap (grad raises).
Tested against the reference and a float64 oracle in tests/kvcache/test_activations.py.
"""

from __future__ import annotations

import logging
import os

from kvcache.blas import preload_openblas

preload_openblas()

import mlx.core as mx  # noqa: E402  (after the BLAS preload, on purpose)
import mlx.nn as nn  # noqa: E402

from kvcache import _ext  # noqa: E402

__all__ = ["BACKENDS", "KINDS", "activation_backend", "gated_activation"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "kernel", "reference")
KINDS = ("silu", "gelu_pytorch_tanh", "gelu")
_KERNEL_OPS = {"silu": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul"}  # kind -> extension function
_KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_REFERENCE = {
    "silu": lambda gate, up: nn.silu(gate) * up,
    "gelu_pytorch_tanh": lambda gate, up: nn.gelu_approx(gate) * up,
    "gelu": lambda gate, up: nn.gelu(gate) * up,
}
_state: dict[str, object] = {}


def _kernels():
    """The extension module when it has the activation kernels, else None (a build that predates
    them is reported once: rebuild with python -m kvcache._ext.build)."""
    module = _ext.load()
    if module is None:
        return None
    if "stale" not in _state:
        _state["stale"] = not all(hasattr(module, name) for name in _KERNEL_OPS.values())
        if _state["stale"]:
            logger.warning("kvcache/_ext was built before the activation kernels; using the MLX "
                           "expression. Rebuild: python -m kvcache._ext.build")
    return None if _state["stale"] else module


def activation_backend() -> str:
    """"kernel" when gated activations go through the C++ extension, else "reference".

    METRALE_KERNELS selects: "auto" (default) uses the kernel where it is built and runs (the CPU
    device), "reference" forces the plain-MLX expression, "kernel" requires the kernel (RuntimeError
    if it is not available, for benchmarks and CI that must measure it).
    """
    choice = os.environ.get("METRALE_KERNELS", "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"METRALE_KERNELS={choice!r}: expected one of {', '.join(BACKENDS)}")
    if choice == "reference":
        return "reference"
    available = mx.default_device() == mx.cpu and _kernels() is not None
    if choice == "kernel" and not available:
        raise RuntimeError(
            "METRALE_KERNELS=kernel but the activation kernels are not available on "
            f"{mx.default_device()} (build them: python -m kvcache._ext.build)"
        )
    return "kernel" if available else "reference"


def gated_activation(gate: mx.array, up: mx.array, kind: str) -> mx.array:
    """act(gate) * up for an MLP's gate and up projections, both (..., intermediate).

    kind: one of KINDS (see the module docstring). gate and up must have the same shape (no
    broadcasting; ValueError otherwise, on either backend). Returns that shape; the dtype is
    gate's when both share it, else MLX's promotion of the two.
    """
    if kind not in _REFERENCE:
        raise ValueError(f"unknown gated activation {kind!r}: expected one of {', '.join(KINDS)}")
    if gate.shape != up.shape:
        raise ValueError(f"gated_activation: gate {gate.shape} and up {up.shape} must have the same shape")
    backend = activation_backend()  # validates METRALE_KERNELS whatever the kind
    op = _KERNEL_OPS.get(kind)
    if backend == "kernel" and op is not None and gate.dtype == up.dtype and gate.dtype in _KERNEL_DTYPES:
        return getattr(_ext.load(), op)(gate, up)
    return _REFERENCE[kind](gate, up)
