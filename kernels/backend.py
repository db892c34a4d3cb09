"""Which implementation runs, decided in one place.

    METRALE_ATTENTION  auto | kernel | reference   paged attention: decode rows and prefill softmax
    METRALE_KERNELS    auto | kernel | reference   gated MLP activations (SwiGLU, GeGLU)
    METRALE_MATMUL     auto | kernel | reference   linear layers of quantized weights kept quantized:
                                                   the CPU kernels (kernels/qmm.py) or MLX's quantized_matmul
    METRALE_CPU_ISA    auto | scalar | avx2 | avx512   the kernels' instruction set (kernels/ext.py)
    METRALE_QMM_ACTIVATIONS  int16 | int8          the kernels' activation precision (matmul_activation_bits)

"auto" (the default) takes the C++ kernel where it is built and runs (the CPU device), "reference"
forces the plain-MLX path (every device), "kernel" requires the kernel and raises RuntimeError when
it is not available (for benchmarks and CI that must measure it).

The runner reads the choice once, when it loads the model (`select_backends`); the per-step code
only reads what was decided then. The two `*_backend()` functions read the environment on every call
and are meant for that one decision and for tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from kernels import ext
from kernels.runtime import mx

CHOICES = ("auto", "kernel", "reference")


@dataclass(frozen=True, slots=True)
class Backends:
    """The implementations one model runs with: "kernel" or "reference" for each."""

    attention: str
    activations: str
    matmul: str = "reference"

    def describe(self) -> str:
        """One line for the startup log: which kernel set runs, or how to build it."""
        chosen = f"matmul={self.matmul} attention={self.attention} activations={self.activations}"
        if mx.default_device() != mx.cpu:
            return f"{chosen} (device {mx.default_device()}: MLX's own kernels)"
        module = ext.load()
        if module is None:
            return (f"{chosen}: CPU kernels not built (quantized weights run as float32, about 5x slower at "
                    "one stream); build them: python -m kernels.build")
        return f"{chosen}: CPU kernels {ext.cpu_isa() or 'unknown'} (of {', '.join(ext.supported_isas())}) from {module.__file__}"


def select_backends() -> Backends:
    """Read METRALE_ATTENTION, METRALE_KERNELS and METRALE_MATMUL once (ValueError / RuntimeError as
    described above)."""
    return Backends(attention=attention_backend(), activations=activation_backend(), matmul=matmul_backend())


def attention_backend() -> str:
    """"kernel" when paged attention goes through the C++ extension, else "reference"."""
    return _choose("METRALE_ATTENTION", lambda: ext.load() is not None, "the paged decode kernel")


def activation_backend() -> str:
    """"kernel" when gated activations go through the C++ extension, else "reference"."""
    return _choose("METRALE_KERNELS", ext.has_activation_kernels, "the activation kernels")


def matmul_backend() -> str:
    """"kernel" when quantized linear layers go through the CPU kernels, else "reference" (MLX's
    quantized_matmul: fast on a GPU, a slow reference on CPU, where the loader dequantizes instead)."""
    return _choose("METRALE_MATMUL", ext.has_qmm_kernels, "the quantized matmul kernels")


def matmul_activation_bits() -> int:
    """16 or 8: how finely the quantized matmul kernels round activations (per 32 values).

    int8 is llama.cpp's Q8 (the fastest); int16 (the default, METRALE_QMM_ACTIVATIONS) runs two int8
    passes and keeps the model's logits within float32 noise of the dequantized model's (int8's
    error flips some greedy tokens: docs/quantized-kernels.md)."""
    choice = os.environ.get("METRALE_QMM_ACTIVATIONS", "int16").lower()
    if choice not in ("int16", "int8"):
        raise ValueError(f"METRALE_QMM_ACTIVATIONS={choice!r}: expected int16 or int8")
    return 16 if choice == "int16" else 8


def _choose(variable: str, built: Callable[[], bool], what: str) -> str:
    """The choice of `variable`; the extension is only looked at when the choice is not "reference"."""
    choice = os.environ.get(variable, "auto").lower()
    if choice not in CHOICES:
        raise ValueError(f"{variable}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "reference":
        return "reference"
    available = mx.default_device() == mx.cpu and built()
    if choice == "kernel" and not available:
        raise RuntimeError(f"{variable}=kernel but {what} is not available on {mx.default_device()} "
                           "(build it: python -m kernels.build)")
    return "kernel" if available else "reference"
