"""Running a kernel call on one kernel set. The kernels read the chosen set when MLX evaluates, not when the
graph is built, so the result is evaluated before the set is restored: a lazy array returned past the switch
would run on the restored set (and a comparison of two sets would compare one set with itself)."""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from kernels import ext


def evaluated_on(isa: str, fn: Callable[[], Any]) -> Any:
    """fn()'s result (arrays, or trees of them, evaluated) with `isa` the chosen kernel set; "auto" after."""
    ext.set_cpu_isa(isa)
    try:
        out = fn()
        if not isinstance(out, str):
            mx.eval(out)
        return out
    finally:
        ext.set_cpu_isa("auto")
