"""A real `metrale serve` subprocess on 127.0.0.1 for tests, and small stdlib HTTP helpers.

    with ServerProcess("--max-num-seqs", "4") as server:
        server.url("/v1")                   # base_url for the openai client
        server.metric("metrale_requests_running")
        status, body = server.post("/v1/completions", b"...")
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
# Small and fast to start: a short context and a small KV pool are plenty for tests.
SMALL = ("--max-model-len", "512", "--kv-cache-mib", "64")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`metrale serve --host 127.0.0.1 --port <free> *args`, ready once /health is 200."""

    def __init__(self, *args: str, startup_timeout_s: float = 240.0, env: dict[str, str] | None = None,
                 memory_limit_bytes: int | None = None) -> None:
        self.args = args
        self.env = env or {}
        self.memory_limit_bytes = memory_limit_bytes  # RLIMIT_AS: a runaway server fails alone, not the machine
        self.port = free_port()
        self.startup_timeout_s = startup_timeout_s
        fd, self.log_path = tempfile.mkstemp(prefix="metrale-serve-", suffix=".log")
        os.close(fd)
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> "ServerProcess":
        start = time.monotonic()
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "metrale.cli", "--log-level", "INFO", "serve", "--host", "127.0.0.1",
                 "--port", str(self.port), *self.args],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                preexec_fn=None if self.memory_limit_bytes is None else self._limit_memory)
        while time.monotonic() - start < self.startup_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"metrale serve exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if self.get("/health")[0] == 200:
                    self.startup_s = time.monotonic() - start
                    return self
            except OSError:
                pass  # not listening yet
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"metrale serve not healthy after {self.startup_timeout_s} s:\n{self.logs()}")

    def _limit_memory(self) -> None:
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_limit_bytes, self.memory_limit_bytes))

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        self.stop()
        if exc_type is None:
            os.unlink(self.log_path)  # kept when a test failed, for its traceback

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (drain), wait, SIGKILL if it hangs; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"metrale serve ignored SIGTERM for {timeout_s} s:\n{self.logs()}")
        return self.proc.returncode

    def logs(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def connection(self, timeout_s: float = 60.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)

    def get(self, path: str) -> tuple[int, bytes]:
        conn = self.connection(timeout_s=10)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def post(self, path: str, body: bytes, timeout_s: float = 60.0,
             headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = self.connection(timeout_s)
        try:
            conn.request("POST", path, body=body, headers={"content-type": "application/json", **(headers or {})})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def post_json(self, path: str, payload: dict, timeout_s: float = 60.0) -> tuple[int, dict]:
        status, body = self.post(path, json.dumps(payload).encode(), timeout_s)
        return status, json.loads(body)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, keyed by (name, sorted labels without model_name)."""
        status, body = self.get("/metrics")
        assert status == 200
        samples = {}
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                samples[(s.name, labels)] = s.value
        return samples

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics()[(name, tuple(sorted(labels.items())))]

    def wait_for(self, predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
        """Poll `predicate(self)` until true; AssertionError with the last metrics after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self):
                return
            time.sleep(0.05)
        raise AssertionError(f"{what} not reached in {timeout_s} s; gauges: {self.gauges()}")

    def gauges(self) -> tuple[float, float, float]:
        """(running, waiting, kv usage)."""
        m = self.metrics()
        return (m[("metrale_requests_running", ())], m[("metrale_requests_waiting", ())],
                m[("metrale_kv_cache_usage_ratio", ())])

    def idle(self) -> bool:
        return self.gauges() == (0.0, 0.0, 0.0)
