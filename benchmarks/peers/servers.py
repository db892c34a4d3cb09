"""Server subprocesses for the comparison: `metrale serve` and llama.cpp's `llama-server`, each on a
free port of 127.0.0.1, ready once GET /health answers 200, stopped with SIGTERM.

    binary = llama_server_binary(None)        # $METRALE_LLAMA_SERVER, the default build, or build it now
    command = llama_server_command(binary, model_path, port, threads=2, parallel=32)
    with ServerProcess(command, "llama.cpp", port) as server:
        server.url, server.pid

llama.cpp is a benchmark-only peer: nothing of it is committed; build_llama_server.sh downloads and
builds it into benchmarks/peers/llama.cpp/ (git-ignored).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

import psutil

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build_llama_server.sh"
ENV_BINARY = "METRALE_LLAMA_SERVER"  # a llama-server binary to use instead of the default build


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`command` (which must listen on 127.0.0.1:`port`) as a subprocess, logging to a temp file
    that is kept when the server fails. Use as a context manager."""

    def __init__(self, command: list[str], name: str, port: int, *, startup_timeout_s: float = 300.0) -> None:
        self.command = command
        self.name = name
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        fd, self.log_path = tempfile.mkstemp(prefix=f"{name.replace('.', '')}-", suffix=".log")
        os.close(fd)
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def __enter__(self) -> "ServerProcess":
        start = time.monotonic()
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        while time.monotonic() - start < self.startup_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} at start:\n{self.tail()}")
            if self._healthy():
                self.startup_s = time.monotonic() - start
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {self.startup_timeout_s} s:\n{self.tail()}")

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        code = self.stop()
        if exc_type is None and code in (0, -signal.SIGTERM):
            os.unlink(self.log_path)
        else:
            print(f"{self.name} log kept: {self.log_path}", file=sys.stderr)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False  # not listening yet, or 503 while loading

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, wait, SIGKILL if it hangs; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def tail(self, lines: int = 30) -> str:
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])


def llama_server_binary(path: str | None = None) -> Path:
    """`path`, else $METRALE_LLAMA_SERVER, else the default build (built now when missing, which
    takes 10-15 min on 2 cores). FileNotFoundError when a given path is not an executable."""
    given = path or os.environ.get(ENV_BINARY)
    if given:
        binary = Path(given).expanduser().resolve()
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise FileNotFoundError(f"no llama-server executable at {binary}")
        return binary
    print(f"llama-server: {BUILD_SCRIPT} (reused when built; otherwise it downloads and builds llama.cpp)",
          file=sys.stderr, flush=True)
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)})
    return Path(out.stdout.strip().splitlines()[-1])


def llama_server_version(binary: Path) -> str:
    """The "version: ..." line of `llama-server --version`."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else f"unknown (--version exited with {out.returncode})"


def llama_server_command(binary: Path, model: Path, port: int, *, threads: int, parallel: int,
                         ctx_per_slot: int = 512, extra: Sequence[str] = ()) -> list[str]:
    """llama-server with `parallel` slots of `ctx_per_slot` tokens each, continuous batching (its
    default), `threads` threads for decode and prompt processing, no web UI."""
    return [str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
            "-c", str(parallel * ctx_per_slot), "-cb", "--host", "127.0.0.1", "--port", str(port), "--no-ui", *extra]


def metrale_serve_command(port: int, *, model: str | None, max_num_seqs: int, extra: Sequence[str] = ()) -> list[str]:
    """`metrale serve` of this Python (so PYTHONPATH and the venv carry over)."""
    command = [sys.executable, "-m", "metrale.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--max-num-seqs", str(max_num_seqs)]
    return command + (["--model", model] if model else []) + list(extra)


def child_pids(pid: int) -> list[int]:
    """The live descendants of `pid` (`metrale serve` runs its engine in a child process)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def loaded_cpu_backend(pid: int) -> str | None:
    """Which ggml CPU backend a running llama-server loaded (the file name, e.g. libggml-cpu-zen4.so),
    or None when it cannot be read (a static build links one backend: libggml-cpu.so)."""
    try:
        paths = [m.path for m in psutil.Process(pid).memory_maps(grouped=True)]
    except (psutil.Error, NotImplementedError):
        return None
    names = sorted({Path(p).name for p in paths if Path(p).name.startswith("libggml-cpu")})
    return ", ".join(names) or None
