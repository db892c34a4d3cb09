"""Resident memory of a server's process tree (the process and all its descendants: `metrale serve`
runs the engine in a child process), read from /proc/PID/status.

    with PeakSampler(pid) as sampler:        # samples the tree's summed VmRSS every 50 ms meanwhile
        ...                                  # one request with a 4k-token prompt
    sampler.peak_rss_bytes, tree_memory(pid)

tree_memory sums VmRSS (now) and VmHWM (each process's own peak) over the tree: for one process the
VmHWM sum is its exact peak; for several it bounds the tree's peak from above (their peaks may not
coincide), so the sampled peak of the sum is recorded next to it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import psutil

from peers.servers import child_pids

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")  # kB in /proc/PID/status


def process_memory(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of one process in bytes (those the kernel reports).
    FileNotFoundError / ProcessLookupError when it is gone."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            values[key] = int(rest.split()[0]) * 1024
    return values


def tree_memory(pid: int) -> dict[str, Any]:
    """Summed VmRSS / VmHWM / RssAnon / RssFile (bytes) of `pid`'s tree, and each process's figures."""
    processes = {}
    for p in [pid, *child_pids(pid)]:
        try:
            processes[p] = {"name": psutil.Process(p).name(), **process_memory(p)}
        except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess):
            continue  # exited between the listing and the read: it holds no memory now
    if not processes:
        raise ProcessLookupError(f"no process {pid}")
    totals = {f"{key.lower()}_bytes": sum(p.get(key, 0) for p in processes.values()) for key in _FIELDS}
    return {**totals, "processes": {str(p): v for p, v in processes.items()}}


class PeakSampler:
    """While open, a thread sums the tree's VmRSS every `interval_s`; peak_rss_bytes is the largest sum."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.pid = pid
        self.interval_s = interval_s
        self.peak_rss_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def _sample(self) -> None:
        try:
            rss = tree_memory(self.pid)["vmrss_bytes"]
        except ProcessLookupError:
            return  # the server is gone: its peak so far stands
        self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "PeakSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
