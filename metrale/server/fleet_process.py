"""One process of `metrale fleet` (a replica or the router): started so that it dies with the fleet.

    start      its own session (Ctrl-C in the fleet's terminal reaches only the fleet), stdin closed,
               stdout+stderr copied to the fleet's stderr line by line, prefixed with the process name
    dies with  PR_SET_PDEATHSIG = SIGKILL (Linux), set between fork and exec: the kernel kills the child
    the fleet  when the thread that forked it ends, so the fleet starts every child from its main thread
               and a SIGKILLed fleet leaves no replica or router holding the port and its memory. A
               fleet that died before the child set it is seen (the parent pid changed): the child exits.
    stop       SIGTERM to the process; then SIGKILL to its process group (its session), so that whatever
               it started goes with it.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading

__all__ = ["Child", "parent_death_signal_supported"]

_PR_SET_PDEATHSIG = 1
_ANSI_ESCAPE = re.compile(rb"\x1b\[[0-9;]*m")  # the router colours its log even into a pipe


def parent_death_signal_supported() -> bool:
    return sys.platform.startswith("linux")


def _die_with(parent_pid: int) -> None:  # runs in the child between fork and exec: no locks, no imports
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        os._exit(126)
    if os.getppid() != parent_pid:  # the fleet died before prctl: nothing will send the signal
        os._exit(1)


class Child:
    """One process of the fleet; `start` may be called again after it exited (a restart)."""

    def __init__(self, name: str, argv: list[str], url: str) -> None:
        self.name = name
        self.argv = argv
        self.url = url
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._pump: threading.Thread | None = None

    def start(self, env: dict[str, str]) -> None:
        """Start (or restart) the process. Call from the main thread (the parent-death signal's owner)."""
        if self.running:
            raise RuntimeError(f"{self.name} (pid {self.pid}) is still running")
        preexec = None
        if parent_death_signal_supported():
            fleet_pid = os.getpid()
            preexec = lambda: _die_with(fleet_pid)  # noqa: E731
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=preexec)
        self.starts += 1
        self._pump = threading.Thread(target=self._copy_output, args=(self.proc,), name=f"fleet-{self.name}-log",
                                      daemon=True)
        self._pump.start()

    def _copy_output(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            sys.stderr.write(f"[{self.name}] {_ANSI_ESCAPE.sub(b'', line).decode(errors='replace')}")
        sys.stderr.flush()
        proc.stdout.close()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_status(self) -> int | None:
        """None while running or before the first start; negative: killed by that signal."""
        return None if self.proc is None else self.proc.poll()

    def describe_exit(self) -> str:
        status = self.exit_status
        if status is not None and status < 0:
            return f"was killed by {signal.Signals(-status).name}"
        return f"exited with status {status}"

    def signal(self, sig: int) -> None:
        """Send `sig` to the process, if it is running (what it started is its own business: a replica
        drains its tensor-parallel ranks itself)."""
        if self.running:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:  # exited between the check and the signal
                pass

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the process and everything it started (its process group), even once it exited."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:  # nothing left in the group
                pass

    def wait(self, timeout_s: float) -> bool:
        """True once the process has exited (within timeout_s); its last log lines are copied."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            return False
        if self._pump is not None:
            self._pump.join(2.0)
        return True

    def terminate(self, grace_s: float) -> None:
        """SIGTERM (the router stops listening and lets its requests finish; a replica drains), then
        `kill` once it exited or after grace_s. Blocks until the process has exited."""
        self.signal(signal.SIGTERM)
        self.wait(grace_s)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the process group (the process if it still runs, and whatever it left behind)."""
        self.signal_group(signal.SIGKILL)
        self.wait(30.0)
