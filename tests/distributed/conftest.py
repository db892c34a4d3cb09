"""Every test here may start ranks: each gets a tag in its environment that the processes it starts
inherit, and ends with none of them left (they are killed, and the test fails, if any is)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TAG = "METRALE_TEST_PROCESS_TAG"


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries `tag` (this one excluded)."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            pass
    return found


@pytest.fixture(autouse=True)
def no_orphans(monkeypatch):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG, tag)
    yield tag
    deadline = time.monotonic() + 10
    while (left := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert left == [], f"processes left behind by the test: {left}"


def run_driver(*args: str, timeout_s: float = 90, env: dict[str, str] | None = None) -> dict:
    """Run tests/distributed/driver.py as rank 0 of a fresh group; its JSON result. A driver that
    runs past timeout_s is killed (its ranks die with it: PR_SET_PDEATHSIG)."""
    result = subprocess.run([sys.executable, "-m", "tests.distributed.driver", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert result.returncode == 0 and lines, f"driver {args} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return json.loads(lines[-1])
