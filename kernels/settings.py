"""The kernels' part of the runtime settings: plain values, read once and passed down.

metrale.settings.RuntimeSettings holds one `KernelSettings` (docs/settings.md is the one table of every
METRALE_* variable); kernels/, kvcache/ and the models take it from here without importing metrale.

The decisions made from it (which backend runs, the matmul kernels' activation precision) are taken
when a model and its KV pools are built. The engine builds them inside `applied(settings)`, on its MLX
thread; code that builds kernels without an engine (tests, benchmarks) gets `from_environ()`, read at
each decision, so that a test may set a variable and build again.

This module imports neither mlx nor metrale.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

BACKEND_CHOICES = ("auto", "kernel", "reference")
# METRALE_QMM_ACTIVATIONS -> activation bits; 0: auto, chosen per call (kernels.backend.activation_bits_for)
ACTIVATION_PRECISIONS = {"auto": 0, "int16": 16, "int12": 12, "int8": 8}
DEFAULT_SPIN_US = 50


@dataclass(frozen=True, slots=True)
class KernelSettings:
    """Which implementations may run, and how the CPU kernels run (each field: its variable)."""

    attention: str = "auto"  # METRALE_ATTENTION: paged attention (decode rows, prefill softmax, K/V writes)
    activations: str = "auto"  # METRALE_KERNELS: gated activations, fused RMSNorm and RoPE
    matmul: str = "auto"  # METRALE_MATMUL: quantized linear layers kept quantized (CPU kernels)
    qmm_activations: str = "int12"  # METRALE_QMM_ACTIVATIONS: auto | int16 | int12 | int8 activations of those kernels
    # process-wide, applied once (kernels/ext.py when the extension loads, kernels/runtime.py before mlx):
    cpu_isa: str = "auto"  # METRALE_CPU_ISA: the kernels' instruction set (the extension checks the name)
    openblas: str | None = None  # METRALE_OPENBLAS: the library's path, "none", or None to search
    attention_threads: int | None = None  # METRALE_ATTENTION_THREADS: kernel threads (None: one per CPU)
    spin_us: int | None = None  # METRALE_SPIN_US: how long an idle kernel thread spins (None: DEFAULT_SPIN_US)

    def __post_init__(self) -> None:
        for variable, value in (("METRALE_ATTENTION", self.attention), ("METRALE_KERNELS", self.activations),
                                ("METRALE_MATMUL", self.matmul)):
            if value not in BACKEND_CHOICES:
                raise ValueError(f"{variable}={value!r}: expected one of {', '.join(BACKEND_CHOICES)}")
        if self.qmm_activations not in ACTIVATION_PRECISIONS:
            raise ValueError(f"METRALE_QMM_ACTIVATIONS={self.qmm_activations!r}: expected auto, int16, int12 or int8")
        for variable, number, low in (("METRALE_ATTENTION_THREADS", self.attention_threads, 1),
                                      ("METRALE_SPIN_US", self.spin_us, 0)):
            if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < low):
                raise ValueError(f"{variable}={number!r}: expected an integer >= {low}")

    @property
    def activation_bits(self) -> int:
        """16, 12 or 8: how finely the quantized matmul kernels round activations; 0 for auto (per call)."""
        return ACTIVATION_PRECISIONS[self.qmm_activations]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "KernelSettings":
        """The kernel variables of `environ` (default os.environ); unset or empty ones keep their default.
        ValueError names a variable whose value is not allowed."""
        env = os.environ if environ is None else environ

        def text(variable: str, default: str) -> str:
            return (env.get(variable) or default).lower()

        return cls(attention=text("METRALE_ATTENTION", "auto"), activations=text("METRALE_KERNELS", "auto"),
                   matmul=text("METRALE_MATMUL", "auto"), qmm_activations=text("METRALE_QMM_ACTIVATIONS", "int12"),
                   cpu_isa=text("METRALE_CPU_ISA", "auto"), openblas=openblas_choice(env),
                   attention_threads=environ_number(env, "METRALE_ATTENTION_THREADS"),
                   spin_us=environ_number(env, "METRALE_SPIN_US"))


def openblas_choice(environ: Mapping[str, str] | None = None) -> str | None:
    """METRALE_OPENBLAS alone: kernels/runtime.py needs it before mlx loads, before anything else is read."""
    return (os.environ if environ is None else environ).get("METRALE_OPENBLAS") or None


def environ_number(env: Mapping[str, str], variable: str, kind: type[int] | type[float] = int) -> int | float | None:
    """`variable` of `env` as an int (or float), None when unset or empty; ValueError naming it otherwise."""
    raw = env.get(variable)
    if not raw:
        return None
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{variable}={raw!r}: expected {'an integer' if kind is int else 'a number'}") from None


_applied: contextvars.ContextVar[KernelSettings | None] = contextvars.ContextVar("kernel_settings", default=None)


@contextlib.contextmanager
def applied(settings: KernelSettings) -> Iterator[KernelSettings]:
    """Build models, pools and kernels under `settings` (the engine wraps its load in this)."""
    token = _applied.set(settings)
    try:
        yield settings
    finally:
        _applied.reset(token)


def current() -> KernelSettings:
    """The settings in force: those `applied` now, else the environment's, read now."""
    settings = _applied.get()
    return settings if settings is not None else KernelSettings.from_environ()
