"""`metrale fleet`: N `metrale serve` replicas behind sglang-router, started and stopped together.

    metrale fleet --replicas 2 --port 8000 [--policy cache_aware] [--router-args "..."] [serve options]

    replicas  127.0.0.1:<free port> each: `metrale serve <serve options> --model-alias unknown`
    router    --host:--port: sglang-router (`metrale[router]`) over the replicas' URLs, its own
              Prometheus listener on 127.0.0.1:<free port> (it cannot be turned off, and a taken
              port would crash it)

Start: the replicas, then (all healthy) the router, then (it reports every replica healthy) one
line per process on stdout. SIGTERM, SIGINT or SIGHUP is forwarded once, as SIGTERM, to every
process (each is in its own session, so Ctrl-C reaches only the fleet): the router closes its
listener and lets in-flight requests finish, the replicas drain; the fleet exits 0 when they all
did. A second signal kills them. A process that exits on its own stops the others and the fleet
exits 1: replicas are not restarted (a supervisor such as systemd or Kubernetes restarts the fleet).
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from metrale.server.cli import add_serve_arguments

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
# The model id sglang-router forwards for a chat request without "model".
ROUTER_MODEL_PLACEHOLDER = "unknown"
# Router flags the fleet sets (later --router-args override them). Health checks every 2 s mark a
# dead replica unhealthy within ~4 s; a circuit breaker that opens after 3 failures, below the 5
# attempts a request gets, moves a request that met a dead replica to a live one instead of failing it.
ROUTER_DEFAULTS = ("--log-level", "warn", "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                   "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "10")
# Runs the router with --api-key from $METRALE_API_KEY, so the key is not on a command line.
_ROUTER_MAIN = ("import os, sys\n"
                "from sglang_router.launch_router import launch_router, parse_router_args\n"
                "args = parse_router_args(sys.argv[1:])\n"
                "args.api_key = os.environ.get('METRALE_API_KEY') or None\n"
                "launch_router(args)\n")
DESCRIPTION = __doc__.split("\n\n", 1)[1]
_ANSI_ESCAPE = re.compile(rb"\x1b\[[0-9;]*m")  # the router colours its log even into a pipe


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
    fleet.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for every replica")
    add_serve_arguments(parser)  # --host and --port are the router's; the replicas get free ports
    parser.set_defaults(func=run_fleet)
    return parser


def replica_argv(args: argparse.Namespace, port: int) -> list[str]:
    """`metrale serve` arguments of one replica: every serve option given to the fleet (the API key
    goes by environment), on 127.0.0.1:`port`, answering the router's placeholder model id too."""
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
    return argv


def router_argv(args: argparse.Namespace, worker_urls: list[str], metrics_port: int) -> list[str]:
    """sglang-router's arguments: the fleet's defaults, then the user's --router-args."""
    grace_s = str(int(args.shutdown_timeout) + 5)  # in-flight requests outlive the replicas' drain
    return ["--host", args.host, "--port", str(args.port), "--worker-urls", *worker_urls, "--policy", args.policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--shutdown-grace-period-secs", grace_s, *ROUTER_DEFAULTS, *shlex.split(args.router_args)]


def replica_command(args: argparse.Namespace, port: int) -> list[str]:
    """The command line of one replica."""
    log_level = getattr(args, "log_level", "WARNING")  # `metrale --log-level X fleet ...`
    return [sys.executable, "-m", "metrale.cli", "--log-level", log_level, *replica_argv(args, port)]


def router_command(args: argparse.Namespace, worker_urls: list[str], metrics_port: int) -> list[str]:
    """The router's command line (its API key, if any, comes from $METRALE_API_KEY)."""
    return [sys.executable, "-c", _ROUTER_MAIN, *router_argv(args, worker_urls, metrics_port)]


def _serve_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(parser)
    return [a for a in parser._actions if a.dest not in ("host", "port", "api_key")]


@dataclass
class Child:
    """One process of the fleet; its output goes to our stderr, each line prefixed with its name."""

    name: str
    argv: list[str]
    url: str
    proc: subprocess.Popen | None = None
    _pump: threading.Thread | None = field(default=None, repr=False)

    def start(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._pump = threading.Thread(target=self._copy_output, name=f"fleet-{self.name}-log", daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            sys.stderr.write(f"[{self.name}] {_ANSI_ESCAPE.sub(b'', line).decode(errors='replace')}")
        sys.stderr.flush()

    def join_output(self, timeout_s: float) -> None:
        """Wait for the last lines of an exited process to be copied."""
        if self._pump is not None:
            self._pump.join(timeout_s)

    @property
    def exit_status(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)


class Fleet:
    """The replicas and the router of one `metrale fleet` run."""

    def __init__(self, replicas: list[Child], router: Child, env: dict[str, str], about_router: str = "") -> None:
        self.replicas = replicas
        self.router = router
        self.env = env
        self.about_router = about_router  # printed when ready
        self.signals = 0  # termination signals received

    @property
    def children(self) -> list[Child]:
        return [*self.replicas, self.router]

    def on_signal(self, sig: int, _frame: object) -> None:
        self.signals += 1
        if self.signals > 1:
            for child in self.children:
                child.signal(signal.SIGKILL)

    def run(self, startup_timeout_s: float, stop_timeout_s: float) -> int:
        """Start, report, supervise until a signal or a death; returns the exit status."""
        for replica in self.replicas:
            replica.start(self.env)
        if not self._wait(lambda: all(_get(r.url + "/health")[0] == 200 for r in self.replicas), startup_timeout_s,
                          "replicas healthy"):
            return self.stop(stop_timeout_s, failed=not self.signals)
        self.router.start(self.env)
        api_key = self.env.get("METRALE_API_KEY")
        ready = lambda: _healthy_workers(self.router.url, api_key) == len(self.replicas)  # noqa: E731
        if not self._wait(ready, 120.0, "router ready"):
            return self.stop(stop_timeout_s, failed=not self.signals)
        self._report()
        while not self.signals:
            dead = self._dead()
            if dead is not None:
                _say(f"{dead.name} (pid {dead.proc.pid}) exited with status {dead.exit_status}; stopping the fleet")
                return self.stop(stop_timeout_s, failed=True)
            time.sleep(0.1)
        _say("stopping: the router stops taking requests, the replicas drain")
        return self.stop(stop_timeout_s, failed=False)

    def _wait(self, predicate, timeout_s: float, what: str) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.signals:
            dead = self._dead()
            if dead is not None:
                _say(f"{dead.name} exited with status {dead.exit_status} before {what}")
                return False
            if predicate():
                return True
            if time.monotonic() > deadline:
                _say(f"not {what} after {timeout_s:.0f} s")
                return False
            time.sleep(0.2)
        return False

    def _dead(self) -> Child | None:
        return next((c for c in self.children if c.proc is not None and c.exit_status is not None), None)

    def _report(self) -> None:
        count = len(self.replicas)
        _say(f"ready: {count} replica{'s' if count != 1 else ''} behind sglang-router")
        _say(f"router {self.router.url} pid {self.router.proc.pid} {self.about_router}".rstrip())
        for replica in self.replicas:
            _say(f"{replica.name} {replica.url} pid {replica.proc.pid}")

    def stop(self, timeout_s: float, *, failed: bool) -> int:
        """SIGTERM every process, wait up to timeout_s, SIGKILL what is left; 1 if anything failed."""
        for child in self.children:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _say(f"{child.name} did not stop in {timeout_s:.0f} s: killing it")
                child.signal(signal.SIGKILL)
                child.proc.wait()
            child.join_output(2.0)
        statuses = {c.name: c.exit_status for c in self.children if c.proc is not None}
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
    router = Child("router", router_command(args, [r.url for r in replicas], metrics_port),
                   f"http://{router_host}:{args.port}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.api_key:
        env["METRALE_API_KEY"] = args.api_key
    fleet = Fleet(replicas, router, env, f"({args.policy}), its metrics http://127.0.0.1:{metrics_port}/metrics")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, fleet.on_signal)
    return fleet.run(args.startup_timeout, stop_timeout_s=args.shutdown_timeout + 15.0)


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


def _get(url: str, api_key: str | None = None, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of a GET, or (0, b"") when nothing answers."""
    host_port, _, path = url.removeprefix("http://").partition("/")
    conn = http.client.HTTPConnection(host_port, timeout=timeout_s)
    try:
        conn.request("GET", "/" + path, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        response = conn.getresponse()
        return response.status, response.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def _healthy_workers(router_url: str, api_key: str | None) -> int:
    """Replicas the router has registered and finds healthy (/workers answers 200 from the start;
    /readiness would log a 503 as an error until the first one is in). With an API key, the router
    asks for it on /workers too."""
    status, body = _get(router_url + "/workers", api_key)
    return sum(1 for w in json.loads(body).get("workers", ()) if w.get("is_healthy")) if status == 200 else 0


def _say(message: str) -> None:
    print(f"metrale fleet: {message}", flush=True)
