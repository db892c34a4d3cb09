"""HangWatch (metrale/engine/hang_watch.py) on made-up clocks and frames: silence past the timeout, a step stuck
past the timeout and 50 mean steps while heartbeats still come, and a late check (this process did not run) that
blames nobody. The watch killing a real stopped engine process: test_engine_process.py."""

from __future__ import annotations

from metrale.engine import ipc
from metrale.engine.hang_watch import CHECK_INTERVAL_S, HangWatch


def watched(timeout_s: float = 5.0) -> tuple[HangWatch, list[float]]:
    """A watch checked every CHECK_INTERVAL_S from t=0; `clock[0]` is now."""
    return HangWatch(timeout_s, 0.0), [0.0]


def tick(watch: HangWatch, clock: list[float], frame: object | None = None) -> str | None:
    clock[0] += CHECK_INTERVAL_S
    if frame is not None:
        watch.frame(frame, clock[0])
    return watch.check(clock[0])


def test_beating_child_is_never_hung():
    watch, clock = watched()
    assert all(tick(watch, clock, ipc.Heartbeat()) is None for _ in range(100))


def test_silence_past_the_timeout_is_a_hang():
    watch, clock = watched(timeout_s=5.0)
    tick(watch, clock, ipc.Heartbeat())
    reasons = [tick(watch, clock) for _ in range(12)]  # 6 s of silence
    assert reasons[:9] == [None] * 9  # up to 4.5 s
    assert reasons[10] is not None and reasons[10].startswith("no heartbeat for 5.5 s")


def test_any_frame_counts_as_a_sign_of_life():
    watch, clock = watched(timeout_s=2.0)
    outputs = ipc.Outputs([], ipc.CoreStats())
    assert all(tick(watch, clock, outputs) is None for _ in range(20))


def test_a_step_stuck_while_the_loop_beats_is_a_hang():
    watch, clock = watched(timeout_s=5.0)
    assert tick(watch, clock, ipc.Heartbeat(step_running_s=4.9, mean_step_s=0.01)) is None
    reason = tick(watch, clock, ipc.Heartbeat(step_running_s=5.1, mean_step_s=0.01))
    assert reason is not None and reason.startswith("a step has run for 5.1 s")


def test_a_step_within_50_mean_steps_is_slow_not_hung():
    watch, clock = watched(timeout_s=5.0)
    assert tick(watch, clock, ipc.Heartbeat(step_running_s=40.0, mean_step_s=1.0)) is None
    assert tick(watch, clock, ipc.Heartbeat(step_running_s=51.0, mean_step_s=1.0)) is not None


def test_a_late_check_starts_the_silence_again():
    watch, clock = watched(timeout_s=5.0)
    clock[0] += 60.0  # this process was suspended (or its loop blocked) for a minute
    assert watch.check(clock[0]) is None
    assert [tick(watch, clock) for _ in range(9)] == [None] * 9
    assert tick(watch, clock) is None and tick(watch, clock) is not None  # then 5.5 s of its own silence
