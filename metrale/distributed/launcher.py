"""Start the ranks of a tensor-parallel group on this machine: ports, hostfile, processes, the ring.

The serving process is rank 0; it starts ranks 1..N-1 itself (no `mlx.launch`, whose ports are
fixed and whose exit status ignores failed ranks):

    ports      N free ports on 127.0.0.1 (bound to port 0, all held open until every one is chosen)
    hostfile   [["127.0.0.1:p0"], ["127.0.0.1:p1"], ...] in a temp file: MLX_HOSTFILE; MLX_RANK = r
    followers  `python -m metrale.distributed.follower`; stdin is rank 0's pipe of messages, stdout a
               one-byte hello ("imported, joining the ring now"); stderr is shared with rank 0.
               PR_SET_PDEATHSIG kills a follower when the thread that started it ends, and a closed
               stdin ends it too, so none outlives rank 0. OPENBLAS_NUM_THREADS and
               METRALE_ATTENTION_THREADS default to the CPUs / N, so N ranks do not oversubscribe.
    the ring   mx.distributed.init(backend="ring") blocks in accept/connect holding the GIL, so no
               Python thread can time it out: rank 0 calls it only once every follower said hello
               (a dead follower would leave it in accept forever), under signal.alarm when SIGALRM has
               no handler (its default action ends the process).

mx.distributed keeps one ring group per process and cannot replace it: a process runs at most one
tensor-parallel engine in its lifetime.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kernels.runtime import mx
from metrale.distributed.channel import send_message

__all__ = ["RankProcess", "free_ports", "join_ring", "write_hostfile"]

logger = logging.getLogger(__name__)
HOST = "127.0.0.1"
INIT_TIMEOUT_S = 60  # joining the ring takes 0.05-2 s here; a peer that never connects hangs it forever
_ring_joined = False


def free_ports(count: int, host: str = HOST) -> list[int]:
    """`count` distinct ports free on `host` right now (a later bind may still race another process)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def write_hostfile(size: int, host: str = HOST) -> Path:
    """A temp JSON hostfile for `size` ranks on `host`, one fresh port each; the caller deletes it."""
    fd, path = tempfile.mkstemp(prefix="metrale_ring_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[f"{host}:{port}"] for port in free_ports(size, host)], f)
    return Path(path)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RankProcess:
    """One follower process (rank >= 1), seen from rank 0."""

    def __init__(self, rank: int, size: int, hostfile: Path, setup: Any) -> None:
        """Start rank `rank` of `size` and send it `setup` (its first message)."""
        self.rank = rank
        threads = str(max(1, (os.cpu_count() or 1) // size))
        package_root = str(Path(__file__).resolve().parents[2])  # the folder holding metrale/
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile),
                   PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        env.setdefault("OPENBLAS_NUM_THREADS", threads)
        env.setdefault("METRALE_ATTENTION_THREADS", threads)
        self.process = subprocess.Popen([sys.executable, "-m", "metrale.distributed.follower"], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=_die_with_parent)
        self.pid = self.process.pid
        self.send(setup)

    def send(self, message: Any) -> None:
        """Hand a message to the follower (BrokenPipeError when it is gone)."""
        send_message(self.process.stdin, message)

    def said_hello(self) -> bool:
        """True once the follower has written its hello byte (never blocks); OSError if it exited first."""
        ready, _, _ = select.select([self.process.stdout], [], [], 0)
        if not ready:
            return False
        if not os.read(self.process.stdout.fileno(), 1):
            raise OSError(f"rank {self.rank} (pid {self.pid}) exited before joining: status {self.process.wait()}")
        return True

    def exit_status(self) -> int | None:
        return self.process.poll()

    def describe_exit(self) -> str:
        status = self.process.poll()
        how = f"was killed by signal {-status}" if status is not None and status < 0 else f"exited with status {status}"
        return f"rank {self.rank} (pid {self.pid}) {how}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._close_pipes()

    def stop(self, timeout_s: float) -> None:
        """Close its pipe (it finishes the step it is in and exits); kill it after timeout_s (at once for 0)."""
        if timeout_s <= 0:
            self.kill()
            return
        try:
            self.process.stdin.close()
        except OSError:  # a pipe whose reader is gone: nothing left to tell it
            pass
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("rank %d (pid %d) did not stop within %.0f s: killed", self.rank, self.pid, timeout_s)
        self.kill()

    def _close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def join_ring(rank: int, hostfile: Path) -> mx.distributed.Group:
    """Join the ring group as `rank` (blocks until every rank has joined, holding the GIL)."""
    global _ring_joined
    if _ring_joined:
        raise RuntimeError("this process already joined a tensor-parallel group: mx.distributed cannot start "
                           "another one in the same process (one tensor-parallel engine per process)")
    _ring_joined = True
    os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"] = str(rank), str(hostfile)
    alarm = signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    if alarm:
        logger.info("rank %d joining the ring (the process ends if it takes over %d s)", rank, INIT_TIMEOUT_S)
        signal.alarm(INIT_TIMEOUT_S)
    start = time.monotonic()
    try:
        group = mx.distributed.init(backend="ring", strict=True)
    finally:
        if alarm:
            signal.alarm(0)
    if group.rank() != rank:
        raise RuntimeError(f"joined the ring as rank {group.rank()}, expected {rank}")
    logger.info("rank %d of %d joined the ring in %.2f s", rank, group.size(), time.monotonic() - start)
    return group
