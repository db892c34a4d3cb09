"""CPU accounting between snapshots and the wait for a quiet machine, on made-up numbers."""

from __future__ import annotations

import os

import pytest

from metrale.bench import machine
from metrale.bench.machine import CpuSnapshot, cpu_snapshot, cpu_usage, wait_for_quiet


def test_cpu_shares_between_two_snapshots():
    before = CpuSnapshot(busy_s=100.0, steal_s=1.0, total_s=1000.0,
                         per_process={1: ("engine", 50.0), 2: ("client", 5.0), 3: ("make", 0.0), 4: ("idle", 7.0)})
    # 10 s on 2 cores = 20 CPU s: 16 busy (engine 10, client 1, make 4, 1 not in any process), 0.4 stolen
    after = CpuSnapshot(busy_s=116.0, steal_s=1.4, total_s=1020.0,
                        per_process={1: ("engine", 60.0), 2: ("client", 6.0), 3: ("make", 4.0), 4: ("idle", 7.0),
                                     5: ("new", 0.5)})
    usage = cpu_usage(before, after, {"engine": 1, "client": 2})
    assert usage["machine"] == pytest.approx(0.8) and usage["steal"] == pytest.approx(0.02)
    assert (usage["engine"], usage["client"]) == (pytest.approx(0.5), pytest.approx(0.05))
    assert usage["other"] == pytest.approx(0.25)  # 16 - 10 - 1 = 5 CPU s, kernel threads included
    assert usage["top_other"] == [{"pid": 3, "name": "make", "cpu": 0.2}, {"pid": 5, "name": "new", "cpu": 0.025}]


def test_a_labelled_process_that_ended_counts_nothing_and_bad_order_is_refused():
    before = CpuSnapshot(busy_s=0.0, steal_s=0.0, total_s=10.0, per_process={1: ("gone", 3.0)})
    after = CpuSnapshot(busy_s=2.0, steal_s=0.0, total_s=20.0, per_process={})
    assert cpu_usage(before, after, {"server": 1}) == {"machine": 0.2, "server": 0.0, "other": 0.2, "steal": 0.0,
                                                       "top_other": []}
    with pytest.raises(ValueError, match="not in order"):
        cpu_usage(after, before, {})


def test_a_real_snapshot_sees_this_process():
    snap = cpu_snapshot()
    assert os.getpid() in snap.per_process and 0 < snap.busy_s < snap.total_s


async def test_waits_until_the_others_are_quiet(monkeypatch):
    readings = iter([0.9, 0.5, 0.1])
    seen = []

    def other_busy(labelled, sample_s):
        seen.append(dict(labelled))
        return next(readings)

    monkeypatch.setattr(machine, "other_busy", other_busy)
    messages = []
    quiet = await wait_for_quiet({"server": 7}, max_other_busy=0.15, poll_s=0.0, log=messages.append)
    assert quiet["quiet"] and quiet["other_busy_before"] == 0.1 and len(messages) == 2
    assert seen == [{"server": 7}] * 3 and len(quiet["load_average_before"]) == 3


async def test_gives_up_after_max_wait_and_says_so(monkeypatch):
    monkeypatch.setattr(machine, "other_busy", lambda labelled, sample_s: 0.6)
    quiet = await wait_for_quiet({}, max_other_busy=0.15, max_wait_s=0.0, poll_s=0.0)
    assert not quiet["quiet"] and quiet["other_busy_before"] == 0.6
