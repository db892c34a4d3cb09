"""Running a kernel call on one kernel set. The kernels read the chosen set when MLX evaluates, not when the
graph is built, so the result is evaluated before the set is restored: a lazy array returned past the switch
would run on the restored set (and a comparison of two sets would compare one set with itself). And reading
what the compiler made of a kernel set's function (avx2_disassembly)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
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


BUILD_OBJECTS = Path(__file__).resolve().parents[2] / "kernels" / "build" / "CMakeFiles"


def isa_object(isa: str, source: str = "isa_kernels.cpp") -> Path:
    """Kernel set `isa`'s build object of `source` (left in kernels/build by `python -m kernels.build`)."""
    return BUILD_OBJECTS / f"isa_{isa}.dir" / f"{source}.o"


def avx2_disassembly(symbol: str) -> str | None:
    """objdump's disassembly of the mangled `symbol` in the avx2 kernel set's build object; None without the
    object (no avx2 set built here), objdump, or an objdump that can disassemble one symbol."""
    obj = isa_object("avx2")
    if not obj.exists() or shutil.which("objdump") is None:
        return None
    run = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--disassemble={symbol}", str(obj)],
                         capture_output=True, text=True)
    return run.stdout if run.returncode == 0 and "<" in run.stdout else None
