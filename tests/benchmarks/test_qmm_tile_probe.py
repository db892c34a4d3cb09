"""benchmarks/qmm_tile_probe.cpp, the one-core timing of the AVX2 quantized-matmul tiles that
docs/quantized-kernels.md cites, still builds against the kernel and agrees with its own float64 reference,
with each activation precision, over a K whose blocks end mid-run of the deferred epilogue: 1-8 tokens read
the packed weights; 16 and 33 (pairs and a one-token tail) the panels run_panels unpacks once from
kUnpackMinTokens (16) tokens on."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("c++") or shutil.which("g++")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    if platform.machine() not in ("x86_64", "AMD64") or CXX is None:
        pytest.skip("x86-64 with a C++ compiler")
    exe = tmp_path_factory.mktemp("qmm_tile_probe") / "probe"
    subprocess.run([CXX, "-std=c++20", "-O2", "-mavx2", "-mfma", "-mf16c", f"-I{ROOT / 'kernels' / 'csrc'}",
                    str(ROOT / "benchmarks" / "qmm_tile_probe.cpp"), "-o", str(exe)], check=True)
    # AVX2 code: run it only where the CPU has AVX2 (the build above is checked everywhere)
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or "avx2" not in cpuinfo.read_text():
        pytest.skip("no AVX2 in /proc/cpuinfo")
    return exe


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8, 16, 33])
@pytest.mark.parametrize("activation_bits", [8, 12, 16])
def test_the_tiles_match_the_reference(probe, tokens, activation_bits):
    # K = 1056: 33 blocks, two full runs of 16 and one of a single block
    run = subprocess.run([str(probe), "1056", "3", str(tokens), "2", str(activation_bits)], capture_output=True,
                         text=True)
    out = json.loads(run.stdout)
    assert run.returncode == 0, out
    assert out["tokens"] == tokens and out["gops"] > 0 and out["max_abs_ref"] > 1.0
    assert out["max_abs_err"] <= 1e-5 * out["max_abs_ref"]


def test_the_probe_refuses_a_k_that_is_not_whole_blocks(probe):
    bad = subprocess.run([str(probe), "100", "1", "1", "1", "12"], capture_output=True, text=True)
    assert bad.returncode == 2 and "multiple of 32" in bad.stderr
