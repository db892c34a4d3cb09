"""`metrale fleet` under faults: what clients see when a replica is SIGKILLed or SIGSTOPped under load,
how long the fleet takes to notice and to serve from it again, and what a SIGKILLed fleet leaves.

    .venv/bin/python benchmarks/fleet_faults.py                 # default model, 2 replicas (~3 min here)
    .venv/bin/python benchmarks/fleet_faults.py --tree /work/x  # the same against another checkout

One fleet (`--replicas 2 --policy round_robin --hang-timeout H`), --clients closed-loop clients, each
sending streamed completions of --output-len tokens one after another. Timeline: warm-up, SIGKILL of
replica-0, wait until the fleet says it serves again, settle, SIGSTOP of replica-1, the same, settle,
stop the load, SIGKILL the fleet. Each request is recorded as (start, end, outcome):

    complete     [DONE] after its tokens          error event  an error chunk, then [DONE]
    cut          the body ended without [DONE]    http N       a status other than 200
    connect      the router did not accept the connection (the fleet is down)

Per fault: the seconds from the signal to "out of the router" and to "serving again" (the fleet's own
stdout lines), the outcomes of the requests in flight at the signal and of those started after it until
the replica served again, and the slowest of the latter. Against a tree whose fleet has no supervision
(--tree, without --hang-timeout) the run stops at the first fault if the fleet exits. Prints a table;
writes benchmarks/results/fleet_faults.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server.fleet_helpers import stream_outcome  # noqa: E402  (the tests classify streams the same way)


class Fleet:
    """`metrale fleet` as a subprocess; its stdout lines with the time each arrived."""

    def __init__(self, tree: Path, flags: list[str]) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen([sys.executable, "-m", "metrale.cli", "fleet", "--port", str(self.port), *flags],
                                     cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line.rstrip()))
                self._cond.notify_all()

    def wait_line(self, pattern: str, after: float, timeout_s: float = 600.0) -> float | None:
        """The arrival time of the first line after `after` matching `pattern`; None on timeout or exit."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while time.monotonic() < deadline:
                hit = next((t for t, line in self.lines if t >= after and re.search(pattern, line)), None)
                if hit is not None:
                    return hit
                if self.proc.poll() is not None:
                    return None
                self._cond.wait(1.0)
        return None

    def pids(self) -> dict[str, int]:
        matches = (re.match(r"metrale fleet: (router|replica-\d+) http://\S+ pid (\d+)", line) for _, line in self.lines)
        return {m.group(1): int(m.group(2)) for m in matches if m}


async def one_request(client: httpx.AsyncClient, i: int, output_len: int) -> str:
    body = {"model": "unknown", "prompt": f"Request {i}: tell me a story about the sea.", "max_tokens": output_len,
            "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return f"http {response.status_code}"
            return await stream_outcome(response)
    except httpx.ConnectError:
        return "connect"
    except httpx.TransportError:
        return "cut"


async def load(url: str, clients: int, output_len: int, stop: asyncio.Event, record: list) -> None:
    counter = iter(range(10**9))

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            start = time.monotonic()
            outcome = await one_request(client, next(counter), output_len)
            record.append((start, time.monotonic(), outcome))
            if outcome == "connect":
                await asyncio.sleep(0.2)  # the fleet is down: do not spin

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))


def summarize(record: list, fault_at: float, back_at: float | None) -> dict:
    in_flight = [o for s, e, o in record if s < fault_at < e]
    until = back_at if back_at is not None else float("inf")
    during = [(e - s, o) for s, e, o in record if fault_at <= s < until]
    return {"in_flight": dict(Counter(in_flight)), "started_before_back": dict(Counter(o for _, o in during)),
            "slowest_started_before_back_s": round(max((d for d, _ in during), default=0.0), 2)}


async def fault(fleet: Fleet, name: str, sig: signal.Signals, record: list, settle_s: float) -> dict:
    pid = fleet.pids()[name]
    at = time.monotonic()
    os.kill(pid, sig)
    out_at = await asyncio.to_thread(fleet.wait_line, rf"{name} \(pid {pid}\) .*out of the router", at)
    back_at = await asyncio.to_thread(fleet.wait_line, rf"{name} http://\S+ pid \d+ serving again", at)
    if sig == signal.SIGSTOP and back_at is None:
        os.kill(pid, signal.SIGCONT)
    await asyncio.sleep(settle_s)
    return {"fault": f"{sig.name} {name}", "fleet_alive": fleet.proc.poll() is None,
            "out_of_router_after_s": None if out_at is None else round(out_at - at, 2),
            "serving_again_after_s": None if back_at is None else round(back_at - at, 2),
            **summarize(record, at, back_at)}


def leftovers(fleet: Fleet) -> dict:
    """SIGKILL the fleet: which of its processes are still alive 10 s later, and is its port free."""
    pids = fleet.pids()
    fleet.proc.kill()
    fleet.proc.wait()
    deadline = time.monotonic() + 10
    alive = set(pids.values())
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"}
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)  # clean up after a tree whose children outlive it
    return {"alive_10s_after_sigkill": sorted(name for name, pid in pids.items() if pid in alive)}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "Z"


async def run(args: argparse.Namespace) -> dict:
    flags = ["--replicas", "2", "--policy", "round_robin", *args.fleet_args.split()]
    fleet = Fleet(Path(args.tree), flags)
    if fleet.wait_line(r"replica-1 http", 0.0) is None:
        raise RuntimeError(f"metrale fleet did not start (status {fleet.proc.poll()})")
    stop, record = asyncio.Event(), []
    loader = asyncio.create_task(load(fleet.url, args.clients, args.output_len, stop, record))
    await asyncio.sleep(args.settle)
    steady = len(record)
    faults = [await fault(fleet, "replica-0", signal.SIGKILL, record, args.settle)]
    if fleet.proc.poll() is None:
        faults.append(await fault(fleet, "replica-1", signal.SIGSTOP, record, args.settle))
    stop.set()
    await asyncio.wait_for(loader, 600)
    return {"requests": len(record), "steady_requests_before_first_fault": steady,
            "outcomes": dict(Counter(o for _, _, o in record)), "faults": faults, **leftovers(fleet)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=str(ROOT), help="the checkout whose `metrale fleet` runs")
    parser.add_argument("--fleet-args", default="--hang-timeout 10 --kv-cache-mib 256",
                        help="more `metrale fleet` flags, one string")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--settle", type=float, default=15.0, help="seconds of load before and after each fault")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/fleet_faults.json"))
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "settings": vars(args), **result},
                                         indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
