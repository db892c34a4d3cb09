"""`metrale fleet`: N `metrale serve` replicas behind sglang-router, supervised, started and stopped together.

    metrale fleet --replicas 2 --port 8000 [--policy cache_aware] [--router-args "..."] [serve options]

    replicas  127.0.0.1:<free port> each: `metrale serve <serve options> --model-alias unknown`
    router    --host:--port: sglang-router (`metrale[router]`) over the replicas' URLs, its own
              Prometheus listener on 127.0.0.1:<free port> (it cannot be turned off, and a taken
              port would crash it); --request-timeout bounds every request it forwards, streams included

Start: the replicas, then (all healthy) the router, then (it reports every replica healthy) one
line per process on stdout. Then the fleet supervises: a replica that exits, or whose /health has not
answered "serving" for --hang-timeout seconds (a frozen process, or a step stuck past the engine's
watchdog), is taken out of the router, stopped (its open streams get an error event when it can still
send one), restarted on the same port and put back once it serves; the others keep serving. A router
that exits is restarted too. Each process may restart --max-restarts times in --restart-window
seconds; one more and the fleet stops with status 1 (a crash loop is for systemd or Kubernetes to see).
Every process dies with the fleet, even a SIGKILLed one (Linux: PR_SET_PDEATHSIG).
SIGTERM, SIGINT or SIGHUP is forwarded once, as SIGTERM, to every process (each is in its own session,
so Ctrl-C reaches only the fleet): the router closes its listener and lets in-flight requests finish,
the replicas drain; the fleet exits 0 when they all did. A second signal kills them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import socket
import sys
import time
from typing import Callable

from metrale.server.cli import add_serve_arguments
from metrale.server.fleet_process import Child
from metrale.server.fleet_router import RouterAdmin
from metrale.server.fleet_supervisor import ReplicaSlot, Supervisor, SupervisorConfig

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
# The model id sglang-router forwards for a chat request without "model".
ROUTER_MODEL_PLACEHOLDER = "unknown"
# Router flags the fleet sets (later --router-args override them). Health checks every 2 s mark a
# dead replica unhealthy within ~4 s; a circuit breaker that opens after 3 failures, below the 5
# attempts a request gets, moves a request that met a dead replica to a live one instead of failing it.
ROUTER_DEFAULTS = ("--log-level", "warn", "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                   "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "10")
DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_fleet_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `fleet` subcommand; its `func` default runs it and returns the exit code."""
    parser = subparsers.add_parser("fleet", help="run N serve replicas behind sglang-router",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--replicas", type=int, default=2, help="number of `metrale serve` processes")
    fleet.add_argument("--policy", choices=POLICIES, default="cache_aware", help="the router's routing policy")
    fleet.add_argument("--router-args", default="", metavar="ARGS",
                       help="more sglang-router flags, one string (e.g. \"--balance-abs-threshold 8\")")
    fleet.add_argument("--router-metrics-port", type=int, default=0,
                       help="the router's Prometheus port (default: a free one)")
    fleet.add_argument("--startup-timeout", type=float, default=600.0,
                       help="seconds a replica may take to serve, at the start and after a restart")
    fleet.add_argument("--hang-timeout", type=float, default=30.0,
                       help="a replica whose /health has not said \"serving\" this long is restarted")
    fleet.add_argument("--max-restarts", type=int, default=5,
                       help="restarts of one process within --restart-window before the fleet gives up (exit 1)")
    fleet.add_argument("--restart-window", type=float, default=300.0, help="seconds (see --max-restarts)")
    fleet.add_argument("--request-timeout", type=int, default=600,
                       help="seconds the router lets one request take, a stream included, before cutting it")
    add_serve_arguments(parser)  # --host and --port are the router's; the replicas get free ports
    parser.set_defaults(func=run_fleet)
    return parser


def replica_argv(args: argparse.Namespace, port: int) -> list[str]:
    """`metrale serve` arguments of one replica: every serve option given to the fleet (the API key
    goes by environment), on 127.0.0.1:`port`, answering the router's placeholder model id too and serving
    vLLM's gauge names on /metrics for the router."""
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port)]
    for action in _serve_actions():
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:  # store_true
            argv.append(flag)
        else:
            argv += [token for item in (value if isinstance(value, list) else [value]) for token in (flag, str(item))]
    if ROUTER_MODEL_PLACEHOLDER not in (args.model_alias or ()):
        argv += ["--model-alias", ROUTER_MODEL_PLACEHOLDER]
    if not args.vllm_metric_aliases:  # what routers read from a replica's /metrics
        argv.append("--vllm-metric-aliases")
    return argv


def router_argv(args: argparse.Namespace, worker_urls: list[str], metrics_port: int) -> list[str]:
    """sglang-router's arguments: the fleet's defaults, then the user's --router-args."""
    grace_s = str(int(args.shutdown_timeout) + 5)  # in-flight requests outlive the replicas' drain
    return ["--host", args.host, "--port", str(args.port), "--worker-urls", *worker_urls, "--policy", args.policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--shutdown-grace-period-secs", grace_s, "--request-timeout-secs", str(args.request_timeout),
            *ROUTER_DEFAULTS, *shlex.split(args.router_args)]


def replica_command(args: argparse.Namespace, port: int) -> list[str]:
    """The command line of one replica."""
    log_level = getattr(args, "log_level", "WARNING")  # `metrale --log-level X fleet ...`
    return [sys.executable, "-m", "metrale.cli", "--log-level", log_level, *replica_argv(args, port)]


def router_command(args: argparse.Namespace, worker_urls: list[str], metrics_port: int) -> list[str]:
    """The router's command line (its API key, if any, comes from $METRALE_API_KEY)."""
    return [sys.executable, "-m", "metrale.router_main", *router_argv(args, worker_urls, metrics_port)]


def _serve_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(parser)
    return [a for a in parser._actions if a.dest not in ("host", "port", "api_key")]


class Fleet:
    """The replicas and the router of one `metrale fleet` run."""

    def __init__(self, replicas: list[Child], router_for: Callable[[list[str]], list[str]], router_url: str,
                 env: dict[str, str], config: SupervisorConfig, about_router: str = "") -> None:
        self.slots = [ReplicaSlot(replica, config) for replica in replicas]
        self.router = Child("router", router_for([r.url for r in replicas]), router_url)
        self.router_for = router_for  # worker URLs -> the router's command line
        self.env = env
        self.config = config
        self.about_router = about_router  # printed when ready
        self.admin = RouterAdmin(router_url, env.get("METRALE_API_KEY"))
        self.signals = 0  # termination signals received

    @property
    def children(self) -> list[Child]:
        return [*(slot.child for slot in self.slots), self.router]

    def on_signal(self, sig: int, _frame: object) -> None:
        self.signals += 1
        if self.signals > 1:
            for child in self.children:
                child.signal_group(signal.SIGKILL)

    def start_router(self, worker_urls: list[str]) -> None:
        self.router.argv = self.router_for(worker_urls)
        self.router.start(self.env)

    def run(self, stop_timeout_s: float) -> int:
        """Start, report, supervise until a signal (or a spent restart budget); returns the exit status."""
        for slot in self.slots:
            slot.start(self.env)
            slot.probe.start()
        if not self._wait(lambda: all(slot.became_serving() for slot in self.slots), self.config.startup_timeout_s,
                          "replicas healthy"):
            return self.stop(stop_timeout_s, failed=not self.signals)
        self.router.start(self.env)
        ready = lambda: len(self.admin.healthy_urls()) == len(self.slots)  # noqa: E731
        if not self._wait(ready, 120.0, "router ready"):
            return self.stop(stop_timeout_s, failed=not self.signals)
        for slot in self.slots:
            slot.state = "serving"
        self._report()
        supervisor = Supervisor(self.slots, self.router, self.start_router, self.admin, self.env, self.config, _say)
        while not self.signals and supervisor.failed is None:
            supervisor.tick()
            time.sleep(0.1)
        if supervisor.failed is not None:
            _say(f"{supervisor.failed}; stopping the fleet")
            return self.stop(stop_timeout_s, failed=True)
        _say("stopping: the router stops taking requests, the replicas drain")
        return self.stop(stop_timeout_s, failed=False)

    def _wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.signals:
            dead = next((c for c in self.children if c.proc is not None and not c.running), None)
            if dead is not None:
                _say(f"{dead.name} {dead.describe_exit()} before {what}")
                return False
            if predicate():
                return True
            if time.monotonic() > deadline:
                _say(f"not {what} after {timeout_s:.0f} s")
                return False
            time.sleep(0.2)
        return False

    def _report(self) -> None:
        count = len(self.slots)
        _say(f"ready: {count} replica{'s' if count != 1 else ''} behind sglang-router")
        _say(f"router {self.router.url} pid {self.router.pid} {self.about_router}".rstrip())
        for slot in self.slots:
            _say(f"{slot.child.name} {slot.child.url} pid {slot.child.pid}")

    def stop(self, timeout_s: float, *, failed: bool) -> int:
        """SIGTERM every process, wait up to timeout_s, SIGKILL what is left; 1 if anything failed."""
        for slot in self.slots:
            slot.probe.stop()
        running = [child for child in self.children if child.running]  # not one waiting for its restart
        for child in running:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in running:
            if not child.wait(deadline - time.monotonic()):
                _say(f"{child.name} did not stop in {timeout_s:.0f} s: killing it")
            child.kill()  # what is left of it, and whatever it started
        statuses = {c.name: c.exit_status for c in running}
        if any(status != 0 for status in statuses.values()):
            _say(f"exit statuses: {statuses}")
            failed = True
        return 1 if failed else 0


def run_fleet(args: argparse.Namespace) -> int:
    """Run `metrale fleet` until signalled; returns the exit code."""
    if importlib.util.find_spec("sglang_router") is None:
        print("metrale fleet needs sglang-router: pip install 'metrale[router]'", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print(f"metrale fleet: --replicas must be >= 1, got {args.replicas}", file=sys.stderr)
        return 2
    if "," in args.host:
        print(f"metrale fleet: the router listens on one --host, got {args.host!r}", file=sys.stderr)
        return 2
    try:
        config = SupervisorConfig(hang_timeout_s=args.hang_timeout, startup_timeout_s=args.startup_timeout,
                                  max_restarts=args.max_restarts, restart_window_s=args.restart_window)
    except ValueError as error:
        print(f"metrale fleet: {error}", file=sys.stderr)
        return 2
    if args.request_timeout < 1:
        print(f"metrale fleet: --request-timeout must be >= 1, got {args.request_timeout}", file=sys.stderr)
        return 2
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        socket.create_server((args.host, args.port), family=family).close()
    except OSError as error:
        print(f"metrale fleet: cannot listen on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 1
    *replica_ports, metrics_port = free_ports(args.replicas + 1)
    metrics_port = args.router_metrics_port or metrics_port
    replicas = [Child(f"replica-{i}", replica_command(args, port), f"http://127.0.0.1:{port}")
                for i, port in enumerate(replica_ports)]
    router_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    router_host = f"[{router_host}]" if ":" in router_host else router_host
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.api_key:
        env["METRALE_API_KEY"] = args.api_key
    fleet = Fleet(replicas, lambda urls: router_command(args, urls, metrics_port), f"http://{router_host}:{args.port}",
                  env, config, f"({args.policy}), its metrics http://127.0.0.1:{metrics_port}/metrics")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, fleet.on_signal)
    return fleet.run(stop_timeout_s=args.shutdown_timeout + 15.0)


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that were free on 127.0.0.1 a moment ago."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _say(message: str) -> None:
    print(f"metrale fleet: {message}", flush=True)
