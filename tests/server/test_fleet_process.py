"""A fleet's child process: its own session, it dies with the process that started it, restartable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from metrale.server.fleet_process import Child, parent_death_signal_supported
from tests.server.fleet_helpers import process_state, session_members, wait_gone
from tests.server.serve import ROOT

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
# A parent that starts a Child (which starts a grandchild of its own), prints both pids, then waits.
PARENT = ("import os, sys, time\n"
          "from metrale.server.fleet_process import Child\n"
          "child = Child('sleeper', [sys.executable, '-c', sys.argv[1]], 'http://127.0.0.1:1')\n"
          "child.start(dict(os.environ))\n"
          "print(child.pid, flush=True)\n"
          "time.sleep(600)\n")
CHILD_WITH_GRANDCHILD = ("import subprocess, sys, time\n"
                         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                         "time.sleep(600)\n")


@pytest.mark.skipif(not parent_death_signal_supported(), reason="PR_SET_PDEATHSIG is Linux only")
def test_a_child_dies_when_the_fleet_is_sigkilled():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "import time; time.sleep(600)"], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        assert process_state(child_pid) not in (None, "Z")
        parent.kill()
        parent.wait(30)
        assert wait_gone({child_pid}) == set()
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_terminate_ends_everything_the_child_started():
    child = Child("tree", [sys.executable, "-c", CHILD_WITH_GRANDCHILD], "http://127.0.0.1:1")
    child.start(dict(os.environ))
    try:
        assert os.getsid(child.pid) == child.pid  # its own session: Ctrl-C at the fleet does not reach it
        members: set[int] = set()
        while len(members) < 2:  # the child and its grandchild
            assert child.running, child.describe_exit()
            members = session_members({child.pid})
        child.terminate(grace_s=30.0)
        assert child.describe_exit() == "was killed by SIGTERM"
        assert wait_gone(members) == set()
    finally:
        child.kill()


def test_a_child_restarts_only_after_it_exited():
    child = Child("sleeper", SLEEPER, "http://127.0.0.1:1")
    child.start(dict(os.environ))
    try:
        first = child.pid
        with pytest.raises(RuntimeError, match="still running"):
            child.start(dict(os.environ))
        child.signal(signal.SIGKILL)
        assert child.wait(30.0) and child.describe_exit() == "was killed by SIGKILL"
        child.start(dict(os.environ))
        assert child.running and child.pid != first and child.starts == 2
    finally:
        child.kill()
