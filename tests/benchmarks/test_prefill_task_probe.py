"""benchmarks/prefill_task_probe.cpp, the one-core timing of a paged prefill task that docs/attention.md's
table comes from, still builds against the kernel's signature and computes finite rows."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or CXX is None, reason="x86-64 with a C++ compiler")
def test_the_prefill_task_probe_builds_and_times_a_task(tmp_path):
    exe = tmp_path / "probe"
    subprocess.run([CXX, "-std=c++20", "-O2", "-mavx2", "-mfma", "-mf16c", f"-I{ROOT / 'kernels' / 'csrc'}",
                    str(ROOT / "benchmarks" / "prefill_task_probe.cpp"), "-o", str(exe)], check=True)
    # AVX2 code: run it only where the CPU has AVX2 (the build above is checked everywhere)
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or "avx2" not in cpuinfo.read_text():
        pytest.skip("no AVX2 in /proc/cpuinfo")
    out = json.loads(subprocess.run([str(exe), "600", "5", "2", "3", "9"], check=True, capture_output=True,
                                    text=True).stdout)
    assert out["rows"] == 15 and out["finite"] is True and out["ms"] > 0 and out["gflops"] > 0
    bad = subprocess.run([str(exe), "600", "99", "2", "3", "9"], capture_output=True, text=True)
    assert bad.returncode == 2 and "T <=" in bad.stderr
