"""Build the CPU kernels (quantized matmul, paged decode, causal softmax, gated activations):
`python -m kernels.build [--force]`.

Needs cmake (>= 3.18), a C++20 compiler and nanobind from PyPI (`pip install nanobind`). Writes
kernels/_kernels*.so (ignored by git) through kernels/build/ (sources in kernels/csrc/), then checks
in a fresh interpreter that kernels.ext.load() accepts it. Exit status 0 on success, 1 with the reason
otherwise; the engine works without the kernels (float32 BLAS matmuls, reference attention and
activations), so setup may ignore a failure.
The binary is portable: the kernels are compiled once per instruction set (x86-64: scalar, AVX2,
AVX-512 VNNI; arm64: scalar, NEON, NEON + the int8 dot product) and chosen at run time
(kernels/csrc/isa.cpp), never with -march=native (CMakeLists.txt holds each set's flags).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "csrc"
BUILD_DIR = HERE / "build"


def mlx_cmake_dir() -> Path:
    """share/cmake/MLX inside the installed mlx (a namespace package: its __path__, not __file__)."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("mlx is not installed in this interpreter")
    path = Path(list(spec.submodule_search_locations)[0]) / "share" / "cmake" / "MLX"
    if not (path / "MLXConfig.cmake").exists():
        raise RuntimeError(f"no MLXConfig.cmake under {path}: this mlx wheel ships no CMake config")
    return path


def mlx_version() -> str:
    from importlib.metadata import version

    return version("mlx")


def built_module() -> Path | None:
    hits = sorted(HERE.glob("_kernels*.so"))
    return hits[0] if hits else None


def up_to_date() -> bool:
    """True when the .so is newer than every source and was built for the installed mlx."""
    so, stamp = built_module(), BUILD_DIR / "mlx_version.txt"
    if so is None or not stamp.exists() or stamp.read_text().strip() != mlx_version():
        return False
    sources = [SOURCES / "CMakeLists.txt", *SOURCES.glob("*.cpp"), *SOURCES.glob("*.h")]
    return all(so.stat().st_mtime >= src.stat().st_mtime for src in sources)


def build(force: bool = False) -> Path:
    """Configure and compile; returns the path of the built module. RuntimeError with the reason."""
    if not force and up_to_date():
        return built_module()
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake not found (Debian: apt-get install cmake g++)")
    try:
        import nanobind
    except ModuleNotFoundError as exc:
        raise RuntimeError("nanobind not installed: pip install nanobind") from exc
    configure = [
        "cmake", "-S", str(SOURCES), "-B", str(BUILD_DIR), "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}", f"-DMLX_DIR={mlx_cmake_dir()}",
        f"-Dnanobind_DIR={nanobind.cmake_dir()}", f"-DMETRALE_OUTPUT_DIR={HERE}",
    ]
    jobs = str(max(1, min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)))
    for cmd in (configure, ["cmake", "--build", str(BUILD_DIR), "-j", jobs]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            output = proc.stdout[-4000:] + proc.stderr[-4000:]
            raise RuntimeError(f"{' '.join(cmd[:3])} failed ({proc.returncode}):\n{output}")
    so = built_module()
    if so is None:
        raise RuntimeError(f"build finished but no _kernels*.so in {HERE}")
    (BUILD_DIR / "mlx_version.txt").write_text(mlx_version() + "\n")
    return so


def check_loads() -> None:
    """Load the module in a fresh interpreter, as the engine would; RuntimeError if it is refused."""
    code = "import logging, sys; logging.basicConfig(); from kernels import ext; sys.exit(not ext.load())"
    root = HERE.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"built module does not load:\n{proc.stdout}{proc.stderr}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build metrale's CPU kernels (optional).")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        so = build(force=args.force)
        check_loads()
    except RuntimeError as exc:
        print(f"[kernels] not built; float32 matmuls and the reference attention and activations will be used: {exc}",
              file=sys.stderr)
        return 1
    print(f"[kernels] ready: {so.relative_to(HERE.parent)} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
