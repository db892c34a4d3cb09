"""HangWatch: decides, in the front-end, when its engine process is alive but hung.

A crash ends the pipe (metrale.engine.engine_client sees EOF at once); a child stopped, or stuck in a native
call, keeps it open and says nothing. The child sends a Heartbeat every HEARTBEAT_INTERVAL_S from its event
loop, with the age of the step in flight (metrale.engine.engine_process). The front-end calls `frame` for every
frame it reads and `check` every CHECK_INTERVAL_S:

    silent   no frame for timeout_s: the child's event loop does not run (stopped, or a native call that holds
             the GIL)
    stuck    the step in flight has run for timeout_s and WATCHDOG_FACTOR x the mean step: the MLX thread is
             stuck (a native call that released the GIL), while the child's loop still beats

Silence is counted only while the front-end itself ran: a check that comes late (this process was suspended,
or its loop blocked) starts the count again rather than blame the child.
"""

from __future__ import annotations

from metrale.engine import ipc

WATCHDOG_MIN_S = 60.0  # in-process health: a step running longer than this and WATCHDOG_FACTOR x the mean is stuck
WATCHDOG_FACTOR = 50.0
CHECK_INTERVAL_S = ipc.HEARTBEAT_INTERVAL_S


class HangWatch:
    """What the front-end knows of its engine process's liveness; see the module docstring."""

    def __init__(self, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self._last_frame = now
        self._last_check = now
        self._step_running_s: float | None = None  # as of the last heartbeat
        self._mean_step_s = 0.0

    def frame(self, message: object, now: float) -> None:
        """Any frame from the child (it is alive); a Heartbeat also tells the age of its step in flight."""
        self._last_frame = now
        if isinstance(message, ipc.Heartbeat):
            self._step_running_s, self._mean_step_s = message.step_running_s, message.mean_step_s

    def check(self, now: float) -> str | None:
        """Why the child is hung (for its requests' error and the log), or None."""
        late = now - self._last_check > self.timeout_s / 2
        self._last_check = now
        if late:  # this process did not run: the child's silence is not measured
            self._last_frame = now
            return None
        silent = now - self._last_frame
        if silent > self.timeout_s:
            return f"no heartbeat for {silent:.1f} s"
        step = self._step_running_s
        if step is not None and step > max(self.timeout_s, WATCHDOG_FACTOR * self._mean_step_s):
            return f"a step has run for {step:.1f} s (the mean step takes {self._mean_step_s:.3f} s)"
        return None
