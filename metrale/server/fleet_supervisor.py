"""The fleet's supervisor: restarts a dead or hung replica (and a dead router) while the rest serve.

    replica   starting --/health "serving"--> serving --exited, or hung--> backoff --delay--> starting
                  \\--exited, or not serving by the startup timeout--> backoff
    hung      its /health has not answered "serving" for hang_timeout_s: no answer (a stopped or frozen
              process), or 503 "unhealthy" (the step watchdog: a step far past its expected time, or a
              dead engine). A hung replica is stopped like this: SIGCONT, SIGTERM (drain), once it says
              "draining" a second SIGTERM (open requests are aborted: each stream gets an error event
              and [DONE], which the router forwards), SIGKILL after kill_grace_s.
    router    a replica is in the router's worker list only while it is serving: `reconcile` removes
              the others (DELETE /workers/{id}) and adds it back once it serves (POST /workers). A dead
              router is restarted over the serving replicas.
    budget    each process may restart max_restarts times in restart_window_s, with a doubling delay
              (0.5 s, 1 s, 2 s, ... up to 30 s); one more and the fleet stops with status 1, so that
              systemd or Kubernetes see a crash loop.

Every process is started and stopped from the main thread (the parent-death signal belongs to the thread
that forked); one probe thread per replica only reads /health.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from metrale.server.fleet_process import Child
from metrale.server.fleet_router import RouterAdmin, http_get

__all__ = ["HealthProbe", "ReplicaSlot", "RestartBudget", "Supervisor", "SupervisorConfig"]

RECONCILE_INTERVAL_S = 1.0
READD_AFTER_S = 10.0  # the router registers an added worker in the background, after its own health check


@dataclass(frozen=True)
class SupervisorConfig:
    hang_timeout_s: float = 30.0
    startup_timeout_s: float = 600.0
    kill_grace_s: float = 5.0
    max_restarts: int = 5
    restart_window_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("hang_timeout_s", "startup_timeout_s", "restart_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kill_grace_s < 0 or self.max_restarts < 0:
            raise ValueError(f"kill_grace_s and max_restarts must be >= 0, got {self.kill_grace_s}, "
                             f"{self.max_restarts}")

    @property
    def probe_timeout_s(self) -> float:
        """A /health answer slower than this counts as none (it still has hang_timeout_s to come)."""
        return min(10.0, self.hang_timeout_s / 2)


class RestartBudget:
    """At most `max_restarts` restarts in any `window_s`; the delay before each doubles with the recent ones."""

    def __init__(self, max_restarts: int, window_s: float, first_delay_s: float = 0.5,
                 max_delay_s: float = 30.0) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self._times: deque[float] = deque()

    def next_delay(self, now: float) -> float | None:
        """Record a restart at `now`: the seconds to wait before it, or None when the budget is spent."""
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return None
        self._times.append(now)
        return min(self.max_delay_s, self.first_delay_s * 2 ** (len(self._times) - 1))


class HealthProbe:
    """A thread asking one replica's /health every interval; `last_serving` is when it last said "serving"."""

    def __init__(self, url: str, interval_s: float, timeout_s: float) -> None:
        self.url = url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.last_serving = float("-inf")  # monotonic time the last "serving" answer was asked for
        self.last_state = "not asked yet"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fleet-probe-{url}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            asked = time.monotonic()
            self.last_state = self.ask()
            if self.last_state == "serving":
                self.last_serving = asked
            self._stop.wait(self.interval_s)

    def ask(self) -> str:
        """"serving", another state /health named ("loading", "draining", "unhealthy"), or "no answer"."""
        status, body = http_get(self.url + "/health", timeout_s=self.timeout_s)
        if status == 0:
            return "no answer"
        try:
            return str(json.loads(body).get("status", f"HTTP {status}"))
        except (ValueError, AttributeError):
            return f"HTTP {status}"


class ReplicaSlot:
    """One replica's process, probe, state and restart budget."""

    def __init__(self, child: Child, config: SupervisorConfig) -> None:
        self.child = child
        self.config = config
        self.probe = HealthProbe(child.url, interval_s=min(1.0, config.hang_timeout_s / 4),
                                 timeout_s=config.probe_timeout_s)
        self.budget = RestartBudget(config.max_restarts, config.restart_window_s)
        self.state = "starting"  # | "serving" | "backoff"
        self.since = time.monotonic()
        self.restart_at = 0.0
        self.added_at = float("-inf")  # when the router was last asked to add it

    @property
    def serving(self) -> bool:
        return self.state == "serving"

    def start(self, env: dict[str, str]) -> None:
        self.child.start(env)
        self.state, self.since = "starting", time.monotonic()

    def became_serving(self) -> bool:
        return self.probe.last_serving >= self.since

    def hung_for(self, now: float) -> float | None:
        """Seconds since the replica last said "serving", when that is past the hang timeout."""
        silent = now - max(self.probe.last_serving, self.since)
        return silent if silent > self.config.hang_timeout_s else None

    def stop(self) -> None:
        """Stop the process (see the module docstring); blocks until it has exited."""
        child = self.child
        if not child.running:
            child.wait(0)
            return
        child.signal_group(signal.SIGCONT)  # a stopped process cannot handle the next signals
        child.signal(signal.SIGTERM)
        deadline = time.monotonic() + 1.0
        while child.running and time.monotonic() < deadline and self.probe.ask() not in ("draining", "no answer"):
            time.sleep(0.05)
        child.signal(signal.SIGTERM)  # the second one: abort what is open
        child.wait(self.config.kill_grace_s)
        child.kill()  # what is left of it, and whatever it started


class Supervisor:
    """Keeps the replicas and the router of a started fleet running; `tick` is called by the main loop."""

    def __init__(self, slots: list[ReplicaSlot], router: Child, start_router: Callable[[list[str]], None],
                 admin: RouterAdmin, env: dict[str, str], config: SupervisorConfig,
                 say: Callable[[str], None]) -> None:
        self.slots = slots
        self.router = router
        self.start_router = start_router
        self.admin = admin
        self.env = env
        self.config = config
        self.say = say
        self.router_budget = RestartBudget(config.max_restarts, config.restart_window_s)
        self.router_restart_at: float | None = None
        self.failed: str | None = None  # why the fleet must stop (a restart budget is spent)
        self._next_reconcile = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            self._supervise(slot, now)
        self._supervise_router(now)
        if now >= self._next_reconcile and self.router.running:
            self.reconcile()
            self._next_reconcile = now + RECONCILE_INTERVAL_S

    def _supervise(self, slot: ReplicaSlot, now: float) -> None:
        child = slot.child
        if slot.state == "backoff":
            if now >= slot.restart_at:
                slot.start(self.env)
                self.say(f"{child.name}: restarted, pid {child.pid} (restart {child.starts - 1})")
            return
        if not child.running:
            child.kill()  # whatever it left behind (tensor-parallel ranks, an engine process)
            self._restart(slot, f"{child.name} (pid {child.pid}) {child.describe_exit()}")
        elif slot.state == "starting":
            if slot.became_serving():
                slot.state, slot.since = "serving", now
                self._add(slot)
                self.say(f"{child.name} {child.url} pid {child.pid} serving again, back in the router")
            elif now - slot.since > self.config.startup_timeout_s:
                slot.stop()
                self._restart(slot, f"{child.name} (pid {child.pid}) not serving "
                                    f"{self.config.startup_timeout_s:.0f} s after its start")
        elif (silent := slot.hung_for(now)) is not None:
            pid, last = child.pid, slot.probe.last_state
            self.admin.remove(child.url)  # before stopping it: no new request is sent its way
            slot.stop()
            self._restart(slot, f"{child.name} (pid {pid}) hung: /health not \"serving\" for {silent:.0f} s "
                                f"(last: {last})")

    def _add(self, slot: ReplicaSlot) -> None:
        slot.added_at = time.monotonic()
        self.admin.add(slot.child.url)

    def _restart(self, slot: ReplicaSlot, why: str) -> None:
        self.admin.remove(slot.child.url)
        delay = slot.budget.next_delay(time.monotonic())
        if delay is None:
            self.failed = (f"{why}; {slot.child.name} restarted {self.config.max_restarts} times in "
                           f"{self.config.restart_window_s:.0f} s: giving up")
            return
        slot.state, slot.restart_at = "backoff", time.monotonic() + delay
        self.say(f"{why}: out of the router, restarting it in {delay:g} s")

    def _supervise_router(self, now: float) -> None:
        if self.router.running:
            return
        if self.router_restart_at is None:
            delay = self.router_budget.next_delay(now)
            if delay is None:
                self.failed = f"router {self.router.describe_exit()} too often: giving up"
                return
            self.say(f"router (pid {self.router.pid}) {self.router.describe_exit()}: restarting it in {delay:g} s")
            self.router_restart_at = now + delay
        elif now >= self.router_restart_at:
            self.router.wait(0)
            urls = [s.child.url for s in self.slots if s.serving] or [s.child.url for s in self.slots]
            self.start_router(urls)
            self.router_restart_at = None
            self.say(f"router {self.router.url} pid {self.router.pid} restarted")

    def reconcile(self) -> None:
        """Make the router's worker list the serving replicas (it may have missed an add or a remove)."""
        workers = self.admin.workers()
        if workers is None:
            return  # the router did not answer: next time
        registered = {w["url"] for w in workers}
        now = time.monotonic()
        for slot in self.slots:
            if slot.serving and slot.child.url not in registered and now - slot.added_at > READD_AFTER_S:
                self._add(slot)
            elif not slot.serving and slot.child.url in registered:
                self.admin.remove(slot.child.url)
