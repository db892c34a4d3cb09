"""The arm64 kernel sets (neon, neon_dotprod: kernels/csrc/qmm_neon.h, isa.cpp), cross-compiled and run
under qemu-aarch64, without MLX: tests/kernels/arm/qmm_harness.cpp linked with kernels/csrc/isa.cpp and
isa_kernels.cpp compiled once per kernel set with the flags of kernels/csrc/CMakeLists.txt.

The harness checks each set's quantized matmul against a reference of its arithmetic (bit for bit for
every set but scalar) and prints a digest per case; the x86-64 sets (avx2, avx512) built the same way on
the host must give the same digests as the arm64 ones.

Needs the aarch64 cross compiler and qemu-aarch64 (Debian: apt-get install g++-aarch64-linux-gnu
qemu-user), which CI machines and a plain checkout may lack: the tests then SKIP with that reason
(setup.sh does not install apt packages). qemu checks what the instructions compute, not their speed,
and is not real ARM hardware.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "kernels" / "csrc"
HARNESS = Path(__file__).resolve().parent / "arm" / "qmm_harness.cpp"
CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
ARM_SETS = ("scalar", "neon", "neon_dotprod")
X86_SETS = ("scalar", "avx2", "avx512")
CASES_PER_SET = 180  # qmm_harness.cpp: 2 bits x 2 scale types x 3 activation types x 3 groups x 5 token counts
BUILD_TIMEOUT_S = 600

needs_cross = pytest.mark.skipif(
    shutil.which(CROSS) is None or shutil.which(QEMU) is None,
    reason=f"needs {CROSS} and {QEMU} (Debian: apt-get install g++-aarch64-linux-gnu qemu-user); "
    "CI machines may lack them and setup.sh does not install them",
)
needs_x86_host = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
    reason="the x86-64 side of the comparison needs an x86-64 host with g++",
)


def isa_flags() -> dict[str, list[str]]:
    """ISA_FLAGS_<set> of CMakeLists.txt, so the harness builds each set as the extension does."""
    text = (CSRC / "CMakeLists.txt").read_text()
    return {name: [f for f in body.split() if f != '""']
            for name, body in re.findall(r"set\(ISA_FLAGS_(\w+)\s*([^)]*)\)", text)}


def build_harness(compiler: str, sets: tuple[str, ...], out: Path, base_flags: list[str], link: list[str]) -> Path:
    """Compiles isa_kernels.cpp once per set (two at a time), isa.cpp and the harness; returns the binary."""
    flags = isa_flags()
    common = ["-std=gnu++20", "-O3", "-DNDEBUG", f"-I{CSRC}"]  # CMake: CXX_STANDARD 20 (extensions on), Release
    jobs = [[compiler, *common, *base_flags, f"-DMETRALE_ISA_NS={name}", *flags[name], "-c",
             str(CSRC / "isa_kernels.cpp"), "-o", str(out / f"isa_{name}.o")] for name in sets]
    jobs += [[compiler, *common, *base_flags, "-c", str(src), "-o", str(out / f"{src.stem}.o")]
             for src in (CSRC / "isa.cpp", HARNESS)]
    for start in range(0, len(jobs), 2):
        running = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for cmd in jobs[start:start + 2]]
        for cmd, proc in zip(jobs[start:start + 2], running):
            output, _ = proc.communicate(timeout=BUILD_TIMEOUT_S)
            assert proc.returncode == 0, f"{' '.join(cmd)}\n{output[-4000:]}"
    binary = out / "qmm_harness"
    link_cmd = [compiler, "-o", str(binary), *sorted(str(p) for p in out.glob("*.o")), *link]
    proc = subprocess.run(link_cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return binary


class Run:
    """One harness run: its sets, its best set, its digests per (set, case), its failures."""

    def __init__(self, cmd: list[str]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        self.returncode, self.output = proc.returncode, proc.stdout + proc.stderr
        self.isas: list[str] = []
        self.best = ""
        self.quantized: dict[str, dict[str, str]] = defaultdict(dict)  # set -> case -> digest
        self.outputs: dict[str, dict[str, str]] = defaultdict(dict)
        for line in proc.stdout.splitlines():
            words = line.split()
            if words[:1] == ["isas"]:
                self.isas = words[1:]
            elif words[:1] == ["best"]:
                self.best = words[1]
            elif words[:1] == ["case"]:
                _, isa, case, quantized, outputs = words
                self.quantized[isa][case] = quantized
                self.outputs[isa][case] = outputs
        self.failures = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]

    def assert_passed(self) -> None:
        assert self.returncode == 0 and not self.failures, self.output[-4000:]
        for isa in self.isas:
            assert len(self.outputs[isa]) == CASES_PER_SET, (isa, len(self.outputs[isa]))


@pytest.fixture(scope="module")
def arm_harness(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("arm_harness")
    # plain armv8-a for the baseline sets (the cross compiler's default, pinned); neon_dotprod's own
    # -march comes later on its command line and wins
    return build_harness(CROSS, ARM_SETS, out, ["-march=armv8-a"], ["-static"])


@pytest.fixture(scope="module")
def x86_run(tmp_path_factory) -> Run:
    out = tmp_path_factory.mktemp("x86_harness")
    run = Run([str(build_harness("g++", X86_SETS, out, [], ["-pthread"]))])
    run.assert_passed()
    return run


@needs_cross
@pytest.mark.timeout(BUILD_TIMEOUT_S * 2)
def test_with_dotprod_the_neon_dotprod_set_is_chosen_and_both_arm_sets_match_the_reference(arm_harness):
    run = Run([QEMU, "-cpu", "max", str(arm_harness)])  # qemu's max CPU has FEAT_DotProd
    run.assert_passed()
    assert run.isas == list(ARM_SETS) and run.best == "neon_dotprod"


@needs_cross
@pytest.mark.timeout(BUILD_TIMEOUT_S * 2)
def test_without_dotprod_the_plain_neon_set_is_chosen_and_runs(arm_harness):
    # Cortex-A57 is Armv8.0: no SDOT, so an SDOT anywhere in neon's path would stop it (SIGILL)
    run = Run([QEMU, "-cpu", "cortex-a57", str(arm_harness)])
    run.assert_passed()
    assert run.isas == ["scalar", "neon"] and run.best == "neon"


@needs_cross
@pytest.mark.timeout(BUILD_TIMEOUT_S * 2)
def test_only_the_dotprod_set_contains_sdot(arm_harness):
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump is None:
        pytest.skip("aarch64-linux-gnu-objdump not found (binutils-aarch64-linux-gnu)")
    def sdot_count(name: str) -> int:
        text = subprocess.run([objdump, "-d", str(arm_harness.parent / f"isa_{name}.o")], capture_output=True,
                              text=True, check=True, timeout=BUILD_TIMEOUT_S).stdout
        return len(re.findall(r"\tsdot\t", text))
    assert sdot_count("neon_dotprod") > 0
    assert sdot_count("neon") == 0 and sdot_count("scalar") == 0


@needs_cross
@needs_x86_host
@pytest.mark.timeout(BUILD_TIMEOUT_S * 3)
def test_arm_sets_give_the_x86_sets_bits(arm_harness, x86_run):
    arm = Run([QEMU, "-cpu", "max", str(arm_harness)])
    arm.assert_passed()
    exact = [(run, isa) for run in (arm, x86_run) for isa in run.isas if isa != "scalar"]
    assert {"neon", "neon_dotprod", "avx2"} <= {isa for _, isa in exact}
    cases = arm.outputs["neon"].keys()
    for case in cases:
        digests = {isa: run.outputs[isa][case] for run, isa in exact}
        assert len(set(digests.values())) == 1, (case, digests)
        # the quantized activations too, in every set but x86-64's scalar: the x86-64 baseline has no FMA,
        # so there the group sums xsum += d * sum(X) round twice (with -mfma its digests match too)
        quantized = {(run.best, isa): run.quantized[isa][case] for run in (arm, x86_run) for isa in run.isas
                     if (run is arm or isa != "scalar")}
        assert len(set(quantized.values())) == 1, (case, quantized)
