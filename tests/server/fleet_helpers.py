"""Shared by the fleet tests: a tiny random model, `metrale fleet` as a subprocess, process checks.

    fleet = FleetProcess("--replicas", "2", "--model", path)
    pids = fleet.wait_ready(2)                      # {"router": pid, "replica-0": pid, ...}
    fleet.wait_line(r"replica-0 .* serving again")  # a line of its stdout, waited for
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest

from tests.server.serve import ROOT, free_port

# Ready and back-in-the-router lines: "metrale fleet: replica-0 http://127.0.0.1:4100 pid 123 ..."
PROCESS_LINE = re.compile(r"metrale fleet: (router|replica-\d+) (http://\S+) pid (\d+)")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A random tiny llama GGUF with a 2048-token context (written in a child: keeps mlx out of here)."""
    path = tmp_path_factory.mktemp("fleet") / "tiny.gguf"
    code = ("import sys, mlx.core as mx\n"
            "from mlx.utils import tree_flatten\n"
            "from tests.metrale.model_helpers import tiny_config_dict, write_tiny_gguf\n"
            "from metrale.models.config import ModelConfig\n"
            "from metrale.models.llama import LlamaForCausalLM\n"
            "config = tiny_config_dict(max_position_embeddings=2048)\n"
            "mx.random.seed(0)\n"
            "write_tiny_gguf(sys.argv[1], config, tree_flatten(LlamaForCausalLM(ModelConfig.from_hf_dict(config))"
            ".parameters()))\n")
    subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, check=True, timeout=120)
    return str(path)


class FleetProcess:
    """`metrale fleet` as a subprocess; a thread collects its stdout lines."""

    def __init__(self, *argv: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The processes' logs: to $METRALE_FLEET_STDERR when set (to debug a failure), else nowhere.
        self._stderr = open(os.environ.get("METRALE_FLEET_STDERR", os.devnull), "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "metrale.cli", "fleet", "--port", str(self.port), *argv],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.lines.append("<eof>")
            self._changed.notify_all()

    def wait_line(self, pattern: str, timeout_s: float = 120.0, after: int = 0) -> re.Match:
        """The first stdout line from index `after` on that matches `pattern` (re.search), waited for."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for line in self.lines[after:]:
                    if match := regex.search(line):
                        return match
                if "<eof>" in self.lines or time.monotonic() > deadline:
                    raise AssertionError(f"no line matching {pattern!r} in {timeout_s} s: {self.lines}")
                self._changed.wait(max(0.0, min(1.0, deadline - time.monotonic())))

    def wait_ready(self, replicas: int, timeout_s: float = 180.0) -> dict[str, int]:
        """{process name: pid} once the fleet printed a line per process."""
        self.wait_line(r"metrale fleet: replica-%d http" % (replicas - 1), timeout_s)
        return self.pids()

    def pids(self) -> dict[str, int]:
        """The latest pid the fleet printed for each process."""
        with self._changed:
            matches = [PROCESS_LINE.match(line) for line in self.lines]
        return {m.group(1): int(m.group(3)) for m in matches if m}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)
        self.proc.stdout.close()
        self._stderr.close()


def process_state(pid: int) -> str | None:
    """The state letter in /proc/<pid>/stat ("R", "S", "T", "Z", ...), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def session_members(session_ids: set[int]) -> set[int]:
    """Pids of every live process whose session id is in `session_ids` (a child and all it started)."""
    members = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[3]) in session_ids and fields[0] != "Z":  # fields: state ppid pgrp session ...
            members.add(int(entry))
    return members


def wait_gone(pids: set[int], timeout_s: float = 60.0) -> set[int]:
    """Wait until no pid in `pids` is alive (a zombie counts as gone); the ones still alive."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = {pid for pid in pids if process_state(pid) not in (None, "Z")}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


async def stream_outcome(response) -> str:
    """How a streamed completion (an httpx response with status 200) ended: "complete" ([DONE] after the last
    token), "error event" (an error event, then [DONE]) or "cut" (no [DONE])."""
    error = done = False
    async for line in response.aiter_lines():
        error = error or line.startswith('data: {"error"')
        done = done or line == "data: [DONE]"
    return ("error event" if error else "complete") if done else "cut"
