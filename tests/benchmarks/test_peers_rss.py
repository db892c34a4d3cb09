"""benchmarks/peers/rss.py on a real process tree: a parent whose child holds 64 MiB it has touched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
pytestmark = pytest.mark.timeout(60)
MiB = 2**20
CHILD = "import sys; b = bytearray(64 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); " \
        "sys.stdin.read()"
PARENT = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdin=sys.stdin); "
          "c.wait()")


@pytest.fixture
def rss(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from peers import rss

    return rss


def test_the_tree_sums_the_child_and_the_sampler_sees_the_peak(rss):
    with subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE) as parent:
        assert parent.stdout.readline() == b"ready\n"  # the child has touched its 64 MiB
        memory = rss.tree_memory(parent.pid)
        assert len(memory["processes"]) == 2
        child = next(p for pid, p in memory["processes"].items() if int(pid) != parent.pid)
        assert child["VmRSS"] >= 64 * MiB and child["VmHWM"] >= child["VmRSS"]
        assert memory["vmrss_bytes"] == sum(p["VmRSS"] for p in memory["processes"].values())
        assert memory["vmhwm_bytes"] >= memory["vmrss_bytes"] > 64 * MiB
        with rss.PeakSampler(parent.pid, interval_s=0.01) as sampler:
            pass
        assert sampler.samples >= 2 and sampler.peak_rss_bytes > 64 * MiB
        parent.stdin.close()  # the child reads to the end: both exit
        parent.wait(30)
    with pytest.raises(ProcessLookupError):
        rss.tree_memory(parent.pid)
    with pytest.raises(ValueError, match="interval_s"):
        rss.PeakSampler(1, interval_s=0)
