"""Greedy argmax over the last axis, threaded on the CPU (kernels/csrc/argmax*).

MLX's CPU argmax is one thread: ~10-13 ms for the (32, 128256) float32 logits of a 32-stream decode step
of a Llama-3-vocabulary model, where the kernel splits rows (and, for fewer rows than threads, ranges of
a row) over the kernel pool: ~0.7 ms. The answer is mx.argmax(x, axis=-1)'s, bit for bit:

    dtype     uint32, shape x.shape[:-1]
    ties      the first index of the maximum (-0.0 and +0.0 tie; a row of -inf gives 0)
    NaN       counts as larger than every number: the first NaN's index (checked against mlx 0.32)

Chosen once, like the other kernels (kernels.backend.activation_backend, METRALE_KERNELS): "kernel" on CPU
with an extension that has argmax_rows; float32 input only (other dtypes, a GPU, the reference backend and
an older build run mx.argmax).
"""

from __future__ import annotations

from collections.abc import Callable

from kernels import ext
from kernels.backend import activation_backend
from kernels.runtime import mx

__all__ = ["argmax_fn", "has_argmax_kernel"]

Argmax = Callable[[mx.array], mx.array]


def has_argmax_kernel() -> bool:
    """True when the loaded extension has the argmax kernel (a build that predates it lacks it)."""
    module = ext.load()
    return module is not None and hasattr(module, "argmax_rows")


def _reference(x: mx.array) -> mx.array:
    return mx.argmax(x, axis=-1)


def argmax_fn(backend: str | None = None) -> Argmax:
    """x (..., V) -> (...) uint32, the index of each row's maximum, as mx.argmax(x, axis=-1).
    `backend`: "kernel" | "reference" (None: activation_backend())."""
    backend = activation_backend() if backend is None else backend
    if backend != "kernel" or not has_argmax_kernel():
        return _reference
    kernel = ext.load().argmax_rows

    def argmax(x: mx.array) -> mx.array:
        if x.dtype == mx.float32 and x.ndim >= 1 and x.shape[-1] >= 1:
            return kernel(x)
        return _reference(x)

    return argmax
