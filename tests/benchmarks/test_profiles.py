"""The profiling benchmarks the issue-23 numbers come from: benchmarks/step_profile.py on a prompt chunk, and
benchmarks/roofline_probe.c timing the multiply instructions it names (not a loop the compiler folded)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import types
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
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
                          "--read-roof-mib", "64", "--read-roof-rounds", "3"],
                         check=True, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    profile = json.loads(out.stdout)
    if "read_roof" in profile:  # no probe for this instruction set
        pytest.skip(profile["read_roof"])
    rounds = profile["read_roof_rounds"]
    assert len(rounds) == 3
    for r in rounds:  # each round's shares against that round's probe
        assert r["read_gbs"] > 0 and r["read_huge_gbs"] > 0
        best = max(r["read_gbs"], r["read_huge_gbs"])
        assert r["share_step"] == pytest.approx(r["weight_gbs_step"] / best, abs=0.01)
        assert r["share_matmul"] == pytest.approx(r["weight_gbs_matmul"] / best, abs=0.01)
    assert profile["weight_read_share_step"] == pytest.approx(statistics.median(r["share_step"] for r in rounds), abs=1e-3)
    assert profile["weight_read_share_matmul"] == pytest.approx(statistics.median(r["share_matmul"] for r in rounds), abs=1e-3)
    assert profile["read_gbs"] == pytest.approx(statistics.median(r["read_gbs"] for r in rounds), abs=1e-3)


def test_the_read_rate_counts_the_bytes_the_kernels_read():
    """Symmetric Q4_0 weights: the kernels compute the biases from the scales (bias_per_scale), so a decode
    step streams q and scales only; counting the biases too overstated its read rate by 1/9."""
    from benchmarks.step_profile import weight_bytes
    from kernels import ext
    from kernels.qmm import QuantizedLinearCPU, pack

    if ext.load() is None or not ext.has_qmm_kernels():
        pytest.skip("the CPU kernels are not built")
    w = mx.random.normal((64, 128))
    packed, scales, _ = mx.quantize(w, group_size=32, bits=4)
    symmetric = QuantizedLinearCPU(*pack(packed, scales, -8 * scales, 4, 32), bits=4, group_size=32, columns=[64])
    affine = QuantizedLinearCPU(*pack(packed, scales, -7 * scales, 4, 32), bits=4, group_size=32, columns=[64])
    assert symmetric.bias_per_scale == -8.0 and affine.bias_per_scale == 0.0

    class Model(nn.Module):
        def __init__(self, *layers):
            super().__init__()
            self.layers = list(layers)

    runner = types.SimpleNamespace(model=Model(symmetric, affine))
    q, s, b = (symmetric.q.nbytes, symmetric.scales.nbytes, symmetric.biases.nbytes)
    assert weight_bytes(runner) == (q + s) + (q + s + b)


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
