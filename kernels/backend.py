"""Which implementation runs, decided in one place.

    METRALE_ATTENTION  auto | kernel | reference   paged attention: decode rows and prefill softmax
    METRALE_KERNELS    auto | kernel | reference   gated MLP activations (SwiGLU, GeGLU)

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

    def describe(self) -> str:
        """One line for the startup log."""
        module = ext.load()
        where = f"kernels from {module.__file__}" if module is not None else "no compiled kernels"
        return f"attention={self.attention} activations={self.activations} ({where})"


def select_backends() -> Backends:
    """Read METRALE_ATTENTION and METRALE_KERNELS once (ValueError / RuntimeError as described above)."""
    return Backends(attention=attention_backend(), activations=activation_backend())


def attention_backend() -> str:
    """"kernel" when paged attention goes through the C++ extension, else "reference"."""
    return _choose("METRALE_ATTENTION", lambda: ext.load() is not None, "the paged decode kernel")


def activation_backend() -> str:
    """"kernel" when gated activations go through the C++ extension, else "reference"."""
    return _choose("METRALE_KERNELS", ext.has_activation_kernels, "the activation kernels")


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
