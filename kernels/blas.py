"""Load an optimized BLAS before MLX on Linux CPU.

MLX's Linux CPU wheel links a reference BLAS (float32 matmul near 1.5 GFLOP/s here). Loading
Debian's OpenBLAS with RTLD_GLOBAL before `mlx.core` is imported lets MLX resolve `cblas_sgemm`
to it, about 25x faster. This module never imports mlx itself.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import sys

logger = logging.getLogger(__name__)

_OPENBLAS_GLOBS = (
    "/usr/lib/*/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
_state: dict[str, str | None] = {}


def find_openblas(override: str | None = None) -> str | None:
    """Path of the system OpenBLAS, or None. `override` (KernelSettings.openblas, METRALE_OPENBLAS) is a
    path to use instead; "none" disables."""
    if override:
        return None if override.lower() == "none" else override
    for pattern in _OPENBLAS_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def preload_openblas(override: str | None = None) -> str | None:
    """Load OpenBLAS globally if we are on Linux and mlx is not imported yet; returns its path.
    `override` as in `find_openblas`.

    Called once, before the first `import mlx.core`. Warns once, with the fix, when only the
    reference BLAS is available.
    """
    if "loaded" in _state:
        return _state["loaded"]
    path = None
    if sys.platform.startswith("linux"):
        if "mlx.core" in sys.modules:
            logger.debug("mlx.core already imported; OpenBLAS preload skipped")
        else:
            path = find_openblas(override)
            if path is not None:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            elif (override or "").lower() != "none":
                logger.warning(
                    "OpenBLAS not found: MLX on Linux CPU falls back to its reference BLAS, about 25x "
                    "slower. Fix: apt-get install libopenblas0-pthread (or set METRALE_OPENBLAS=/path/libopenblas.so.0)"
                )
    _state["loaded"] = path
    return path
