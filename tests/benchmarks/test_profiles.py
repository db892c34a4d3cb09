"""The profiling benchmarks the issue-23 numbers come from: benchmarks/step_profile.py on a prompt chunk, and
benchmarks/roofline_probe.c timing the multiply instructions it names (not a loop the compiler folded)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def test_step_profile_splits_a_prompt_chunk(tiny_model):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--model", tiny_model,
                          "--batch", "2", "--chunk", "8", "--context", "16", "--repeat", "1", "--kv-cache-mib", "64"],
                         check=True, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    profile = json.loads(out.stdout)
    assert (profile["batch"], profile["context"], profile["chunk"]) == (2, 16, 8)
    assert profile["step_ms"] > 0 and profile["matmul_ms"] > 0 and profile["matmul_gflops"] > 0
    if profile["attention_backend"] == "kernel":  # the chunk ran the prompt kernel, not the decode one
        assert profile["node_kinds"].get("PagedPrefill", 0) > 0 and "PagedDecode" not in profile["node_kinds"]


@pytest.mark.skipif(shutil.which("cc") is None, reason="the read probe needs a C compiler")
def test_step_profile_measures_the_decodes_share_of_the_read_bandwidth(tiny_model):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--model", tiny_model,
                          "--batch", "1", "--context", "16", "--repeat", "1", "--kv-cache-mib", "64", "--read-roof",
                          "--read-roof-mib", "64"],
                         check=True, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    profile = json.loads(out.stdout)
    if "read_roof" in profile:  # no probe for this instruction set
        pytest.skip(profile["read_roof"])
    assert profile["read_gbs"] > 0 and profile["read_huge_gbs"] > 0
    best = max(profile["read_gbs"], profile["read_huge_gbs"])
    assert profile["weight_read_share_step"] == pytest.approx(profile["weight_gbs_step"] / best, abs=0.01)
    assert profile["weight_read_share_matmul"] == pytest.approx(profile["weight_gbs_matmul"] / best, abs=0.01)


def test_step_profile_refuses_an_ab_of_prompt_chunks():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--ab", "--chunk", "4"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and "--chunk must be 1" in out.stderr


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
                    reason="the probe is x86-64 C")
@pytest.mark.parametrize(("flags", "instruction"), [
    (["-mavx2", "-mfma"], "vpmaddubsw"),
    (["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vnni"], "vpdpbusd"),
])
def test_the_peak_probe_runs_the_multiplies_it_counts(tmp_path, flags, instruction):
    """An earlier AVX2 loop had loop-invariant operands: GCC computed its products once, before the loop, and
    the probe timed a loop of adds. The compiled probe must hold the multiply inside its timed loop."""
    asm = tmp_path / "probe.s"
    subprocess.run(["cc", "-O2", "-fopenmp", *flags, "-S", str(ROOT / "benchmarks" / "roofline_probe.c"), "-o", str(asm)],
                   check=True)
    lines = [line.split("#")[0].strip() for line in asm.read_text().splitlines()]
    bodies = []
    for i, line in enumerate(lines):  # each backward jump's body: from its target label to the jump
        if not line.startswith("j"):
            continue
        target = line.split()[-1]
        label = f"{target[:-1]}:" if target[:-1].isdigit() and target.endswith("b") else f"{target}:"
        start = next((j for j in range(i - 1, -1, -1) if lines[j] == label), None)
        if start is not None:
            bodies.append(lines[start:i])
    assert any(sum(instruction in line for line in body) >= 8 for body in bodies), \
        f"no loop of the probe runs {instruction}"
    if instruction == "vpmaddubsw" and "avx2" in Path("/proc/cpuinfo").read_text():
        exe = tmp_path / "probe"
        subprocess.run(["cc", "-O2", "-fopenmp", *flags, str(ROOT / "benchmarks" / "roofline_probe.c"), "-o", str(exe)],
                       check=True)
        roof = json.loads(subprocess.run([str(exe), "1", "64"], check=True, capture_output=True, text=True).stdout)
        assert roof["isa"] == "avx2 vpmaddubsw+vpaddw" and roof["int8_gops_cpu"] > 0 and roof["read_gbs_cpu"] > 0
        assert roof["read_huge_gbs_cpu"] > 0 and isinstance(roof["huge_pages_advised"], bool)
