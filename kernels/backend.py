"""Which implementation runs, decided in one place, from KernelSettings (kernels/settings.py).

    attention    METRALE_ATTENTION  auto | kernel | reference   paged attention: decode rows and prefill softmax
    activations  METRALE_KERNELS    auto | kernel | reference   gated MLP activations (SwiGLU, GeGLU)
    matmul       METRALE_MATMUL     auto | kernel | reference   linear layers of quantized weights kept quantized:
                                                                the CPU kernels (kernels/qmm.py) or MLX's quantized_matmul

"auto" (the default) takes the C++ kernel where it is built and runs (the CPU device), "reference"
forces the plain-MLX path (every device), "kernel" requires the kernel and raises RuntimeError when
it is not available (for benchmarks and CI that must measure it).

The runner decides once, when it loads the model (`select_backends(settings)`); the per-step code
only reads what was decided then. The `*_backend()` functions decide from the settings in force
(kernels.settings.current(): the engine's while it builds the model, else the environment, read on
every call) for the layers built with the model and for tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernels import ext
from kernels.runtime import mx
from kernels.settings import KernelSettings, current



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


def select_backends(settings: KernelSettings | None = None) -> Backends:
    """Decide attention, activations and matmul once from `settings` (None: the settings in force);
    RuntimeError as described above."""
    settings = settings if settings is not None else current()
    return Backends(attention=attention_backend(settings), activations=activation_backend(settings),
                    matmul=matmul_backend(settings))


def attention_backend(settings: KernelSettings | None = None) -> str:
    """"kernel" when paged attention goes through the C++ extension, else "reference"."""
    choice = (settings or current()).attention
    return _choose("METRALE_ATTENTION", choice, lambda: ext.load() is not None, "the paged decode kernel")


def activation_backend(settings: KernelSettings | None = None) -> str:
    """"kernel" when gated activations go through the C++ extension, else "reference"."""
    choice = (settings or current()).activations
    return _choose("METRALE_KERNELS", choice, ext.has_activation_kernels, "the activation kernels")


def matmul_backend(settings: KernelSettings | None = None) -> str:
    """"kernel" when quantized linear layers go through the CPU kernels, else "reference" (MLX's
    quantized_matmul: fast on a GPU, a slow reference on CPU, where the loader dequantizes instead)."""
    choice = (settings or current()).matmul
    return _choose("METRALE_MATMUL", choice, ext.has_qmm_kernels, "the quantized matmul kernels")


# METRALE_QMM_ACTIVATIONS=auto: calls with at least this many token rows quantize activations to int8
# (prompt chunks, batched decode of 16+ streams), fewer to int16. 16 is the AMX tile's token count.
# A row's precision then depends on what else is in its call: batch invariance no longer holds.
INT8_MIN_TOKENS = 16


def matmul_activation_bits(settings: KernelSettings | None = None) -> int:
    """16, 12, 8, or 0 (auto: per call, activation_bits_for): how finely the quantized matmul kernels round
    activations (per 32 values).

    int8 is llama.cpp's Q8 (the fastest); int12 (the default, 16x finer than int8) is two int8 planes, but
    one AMX tile product per block with 4-bit weights (1.2-1.3x int16 there); int16 runs two int8 passes and
    keeps the model's logits within float32 noise of the dequantized model's. auto takes int8 for calls of
    INT8_MIN_TOKENS rows or more (prompt chunks); it is not the default: on the default model int8 prompts
    flip greedy tokens and change answers, and the choice depends on the batch (docs/quantized-kernels.md)."""
    return (settings or current()).activation_bits


def activation_bits_for(policy: int, tokens: int) -> int:
    """The activation bits of one call of `tokens` token rows under `policy` (16, 12, 8 or 0 = auto)."""
    if policy:
        return policy
    return 8 if tokens >= INT8_MIN_TOKENS else 16


def _choose(variable: str, choice: str, built: Callable[[], bool], what: str) -> str:
    """What `choice` of `variable` gives; the extension is only looked at when it is not "reference"."""
    if choice == "reference":
        return "reference"
    available = mx.default_device() == mx.cpu and built()
    if choice == "kernel" and not available:
        raise RuntimeError(f"{variable}=kernel but {what} is not available on {mx.default_device()} "
                           "(build it: python -m kernels.build)")
    return "kernel" if available else "reference"
