"""The one place mlx is first imported.

On Linux the OpenBLAS preload must run before `mlx.core` loads (MLX's CPU wheel otherwise binds its
slow reference BLAS for good), so every module that uses MLX takes it from here:

    from kernels.runtime import mx, nn

A thread other than the main one that ran MLX makes `release_thread_state()` its last MLX call (the
engine's MLX thread does, metrale.engine.mlx_thread): else the process can abort at exit.
"""

from __future__ import annotations

from kernels.blas import preload_openblas
from kernels.settings import openblas_choice

OPENBLAS_PATH = preload_openblas(openblas_choice())  # once per process, before any settings object exists

import mlx.core as mx  # noqa: E402  (after the preload, on purpose)
import mlx.nn as nn  # noqa: E402

__all__ = ["OPENBLAS_PATH", "mx", "nn", "release_thread_state"]


def release_thread_state() -> None:
    """Drop the MLX state of the calling thread (not the main thread): call it as the thread's last MLX
    call, on that thread; no MLX call may follow there.

    MLX (>= 0.31.2) keeps a per-thread random key, a Python list, in a C++ thread_local whose destructor
    takes the GIL. That destructor runs after the thread's Python state is gone, so after
    Thread.join (and ThreadPoolExecutor.shutdown) has returned: when the interpreter starts finalizing
    first, PyGILState_Ensure ends the thread with pthread_exit, whose forced unwind through that noexcept
    destructor calls std::terminate ("terminate called without an active exception", exit status 134,
    after all output was written; about 1 exit in 30 on a loaded machine once the thread drew from the
    default key, which model construction does: nn.Linear's init). mx.clear_streams drops the key here,
    with the GIL held, and this thread's CPU command encoders (the tasks already queued own what they
    use); the thread then ends with nothing left for its destructors to do. An MLX without clear_streams
    (< 0.31.2) predates that destructor: nothing to do.
    """
    if hasattr(mx, "clear_streams"):
        mx.clear_streams()
