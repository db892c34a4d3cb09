"""Is the machine quiet enough to measure, and who used its CPU during a run (psutil).

On a small shared machine another process's busy thread halves a 2-core result, and engines that
spin at barriers (llama.cpp's ggml threads) collapse far more. So a comparison waits for a quiet
machine before each run and records what else ran during it:

    quiet = await wait_for_quiet({"llama-server": pid}, max_other_busy=0.15)
    before = cpu_snapshot()
    ...                                        # the run
    usage = cpu_usage(before, cpu_snapshot(), {"client": os.getpid(), "llama-server": pid})

CPU shares are fractions of the whole machine over the interval (0..1; 1 = every core busy), so on
2 cores one busy thread is 0.5. "other" is the machine's busy time less the labelled processes'.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import psutil

TOP_OTHER = 3  # other processes listed by name in a usage record


@dataclass(frozen=True)
class CpuSnapshot:
    """Cumulative CPU seconds, summed over cores, at one moment."""

    busy_s: float  # the machine: user, system, irq, ... (not idle, iowait or steal)
    steal_s: float  # taken by the hypervisor for other guests (a noisy host, not this machine)
    total_s: float
    per_process: Mapping[int, tuple[str, float]] = field(default_factory=dict)  # pid -> (name, user + system s)


def cpu_snapshot() -> CpuSnapshot:
    """Every process's CPU seconds and the machine's, now."""
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    steal = getattr(times, "steal", 0.0)
    total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)  # already in user
    per_process = {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        cpu = proc.info["cpu_times"]
        if cpu is not None:  # None: gone or not ours to read
            per_process[proc.pid] = (proc.info["name"] or "?", cpu.user + cpu.system)
    return CpuSnapshot(busy_s=total - idle - steal, steal_s=steal, total_s=total, per_process=per_process)


def cpu_usage(before: CpuSnapshot, after: CpuSnapshot, labelled: Mapping[str, int]) -> dict[str, Any]:
    """Shares of the machine's CPU between two snapshots: "machine", each labelled process,
    "other" (the rest) with its top processes, and "steal"."""
    total = after.total_s - before.total_s
    if total <= 0:
        raise ValueError(f"the snapshots are not in order: total CPU time went {before.total_s} -> {after.total_s}")

    def used(pid: int) -> float:
        if pid not in after.per_process:
            return 0.0
        return after.per_process[pid][1] - before.per_process.get(pid, ("", 0.0))[1]

    mine = {label: used(pid) / total for label, pid in labelled.items()}
    machine = (after.busy_s - before.busy_s) / total
    own_pids = set(labelled.values())
    others = sorted(((used(pid), pid, name) for pid, (name, _) in after.per_process.items() if pid not in own_pids),
                    reverse=True)
    return {"machine": round(machine, 4), **{k: round(v, 4) for k, v in mine.items()},
            "other": round(max(0.0, machine - sum(mine.values())), 4),
            "steal": round((after.steal_s - before.steal_s) / total, 4),
            "top_other": [{"pid": pid, "name": name, "cpu": round(s / total, 4)}
                          for s, pid, name in others[:TOP_OTHER] if s > 0]}


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def other_busy(labelled: Mapping[str, int], sample_s: float = 1.0) -> float:
    """The share of the machine used by processes other than `labelled` (and this one) over
    `sample_s` seconds. Blocks."""
    before = cpu_snapshot()
    time.sleep(sample_s)
    return cpu_usage(before, cpu_snapshot(), {"this": os.getpid(), **labelled})["other"]


async def wait_for_quiet(labelled: Mapping[str, int], *, max_other_busy: float = 0.15, max_wait_s: float = 600.0,
                         sample_s: float = 1.0, poll_s: float = 5.0, log: Any = None) -> dict[str, Any]:
    """Wait until other processes use at most `max_other_busy` of the machine, or `max_wait_s`
    passed. Returns {"quiet": bool, "waited_s", "other_busy_before", "load_average_before"}."""
    start = time.monotonic()
    while True:
        busy = await asyncio.to_thread(other_busy, labelled, sample_s)
        waited = time.monotonic() - start
        if busy <= max_other_busy or waited >= max_wait_s:
            return {"quiet": busy <= max_other_busy, "waited_s": round(waited, 1), "other_busy_before": round(busy, 4),
                    "load_average_before": load_average()}
        if log is not None:
            log(f"machine busy: other processes use {busy:.0%} of it (> {max_other_busy:.0%}); "
                f"waited {waited:.0f} of {max_wait_s:.0f} s")
        await asyncio.sleep(poll_s)
