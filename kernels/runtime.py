"""The one place mlx is first imported.

On Linux the OpenBLAS preload must run before `mlx.core` loads (MLX's CPU wheel otherwise binds its
slow reference BLAS for good), so every module that uses MLX takes it from here:

    from kernels.runtime import mx, nn
"""

from __future__ import annotations

from kernels.blas import preload_openblas
from kernels.settings import openblas_choice

OPENBLAS_PATH = preload_openblas(openblas_choice())  # once per process, before any settings object exists

import mlx.core as mx  # noqa: E402  (after the preload, on purpose)
import mlx.nn as nn  # noqa: E402

__all__ = ["OPENBLAS_PATH", "mx", "nn"]
