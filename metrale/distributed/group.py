"""TensorParallelGroup: rank 0's handle on a tensor-parallel group (the serving process is rank 0).

    spawn()          event-loop thread: start ranks 1..N-1 (metrale.distributed.launcher), send setup
    wait_joining()   event-loop thread (async): every follower said hello, so none is dead before the ring
    join()           MLX thread: join the ring (holds the GIL for 0.05-2 s)
    shard(model)     MLX thread, given to load_model: keep rank 0's share
    start_steps()    MLX thread: tell the followers the KV layout; a barrier (all_sum) ends the startup
    run_step(fn)     MLX thread, per step: send_forward(...) inside fn hands the followers the step's
                     ForwardInput right before rank 0's own forward
    close()          event-loop thread: end the followers (EOF on their pipes), then kill what is left

A monitor thread watches the followers: one that exits, or a step (or the startup barrier) that runs
past its timeout (a stopped or hung rank never raises: its peers wait in a collective forever), fails
the group: the followers are killed, so a collective rank 0 is blocked in raises "[ring] connection
to a peer was lost" at once, and `on_failure(error)` tells the engine (from the monitor thread).
Once failed, every step raises TensorParallelError: the ring cannot be repaired in this process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kernels.runtime import mx, nn
from metrale.distributed.launcher import RankProcess, join_ring, write_hostfile
from metrale.distributed.messages import FollowerSetup, KVLayout
from metrale.distributed.sharding import shard_model
from metrale.engine.step import ForwardInput
from metrale.errors import TensorParallelError

__all__ = ["TensorParallelGroup"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
HELLO_TIMEOUT_S = 120.0  # a follower imports MLX and metrale before its hello
STARTUP_TIMEOUT_S = 900.0  # joining plus loading the model on every rank, until the barrier
STOP_TIMEOUT_S = 10.0
MONITOR_INTERVAL_S = 0.1


def is_ring_error(error: BaseException) -> bool:
    """The ring backend's failures ("[ring] connection to a peer was lost", ...) reach Python as
    RuntimeErrors from mx.eval / tolist with this prefix."""
    return isinstance(error, RuntimeError) and str(error).startswith("[ring]")


class TensorParallelGroup:
    """Rank 0's side of an N-rank tensor-parallel group (see the module docstring)."""

    def __init__(self, size: int, on_failure: Callable[[TensorParallelError], None] | None = None,
                 step_timeout: float = 120.0) -> None:
        """`step_timeout`: seconds a step may run before a rank counts as lost (RuntimeSettings.tp_step_timeout_s,
        METRALE_TP_STEP_TIMEOUT_S)."""
        if size < 2:
            raise ValueError(f"a tensor-parallel group needs at least 2 ranks, got {size}")
        self.size = size
        self.step_timeout = step_timeout
        self.failure: TensorParallelError | None = None
        self._on_failure = on_failure
        self._followers: list[RankProcess] = []
        self._hostfile: Path | None = None
        self._group: mx.distributed.Group | None = None
        self._deadline: float | None = None  # monotonic: the collective in flight must end by then
        self._unlaunched = False  # a step was sent to the followers and rank 0 has not launched its forward
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._monitor: threading.Thread | None = None

    @property
    def followers(self) -> tuple[RankProcess, ...]:
        """The processes of ranks 1..N-1 (their pids, exit status), in rank order."""
        return tuple(self._followers)

    # ---- startup ----

    def spawn(self, model: str | None, weights_dtype: mx.Dtype | None) -> None:
        """Start ranks 1..N-1 (from a thread that outlives them: their parent-death signal follows it)."""
        self._hostfile = write_hostfile(self.size)
        dtype = None if weights_dtype is None else str(weights_dtype).removeprefix("mlx.core.")
        setup = FollowerSetup(model, dtype, self.size)
        try:
            for rank in range(1, self.size):
                self._followers.append(RankProcess(rank, self.size, self._hostfile, setup))
        except BaseException:
            self.close()
            raise
        self._deadline = time.monotonic() + STARTUP_TIMEOUT_S
        self._monitor = threading.Thread(target=self._watch, name="metrale-tp-monitor", daemon=True)
        self._monitor.start()
        logger.info("started %d tensor-parallel ranks: pids %s", self.size - 1, [f.pid for f in self._followers])

    async def wait_joining(self, timeout_s: float = HELLO_TIMEOUT_S) -> None:
        """Wait until every follower is about to join the ring (RuntimeError if one exits or is late)."""
        waiting = list(self._followers)
        deadline = time.monotonic() + timeout_s
        while waiting:
            if self.failure is not None:
                raise self.failure
            try:
                waiting = [f for f in waiting if not f.said_hello()]
            except OSError as error:
                raise TensorParallelError(f"tensor-parallel startup failed: {error}") from None
            if waiting and time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel startup failed: ranks {[f.rank for f in waiting]} did "
                                          f"not start within {timeout_s:.0f} s")
            await asyncio.sleep(0.02)

    def join(self) -> None:
        """Join the ring as rank 0 (MLX thread; every follower is joining too)."""
        self._group = join_ring(0, self._hostfile)

    def shard(self, model: nn.Module) -> None:
        """Keep rank 0's share of `model` (load_model's `shard` hook)."""
        shard_model(model, self._group)

    def start_steps(self, num_blocks: int, block_size: int, kv_dtype: str = "float32") -> None:
        """Tell the followers the KV layout, then wait for every rank at a barrier (MLX thread)."""
        self._send_all(KVLayout(num_blocks, block_size, kv_dtype))
        self._barrier()
        self._deadline = None
        if self._hostfile is not None:  # every rank has read it by now
            self._hostfile.unlink(missing_ok=True)
            self._hostfile = None

    # ---- steps (MLX thread) ----

    def run_step(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one step of rank 0's runner; a failure of the group raises TensorParallelError (the
        engine cannot go on), and so does any error between send_forward and forward_launched: the
        followers would wait in that step's collectives forever."""
        if self.failure is not None:
            raise self.failure
        try:
            return fn(*args)
        except Exception as error:
            if is_ring_error(error):
                self._wait_for_an_exit(0.5)  # a peer that died: name it in the error
            if self.failure is not None or self._unlaunched or is_ring_error(error):
                raise self._fail(f"a step failed on rank 0: {type(error).__name__}: {error}") from error
            raise
        finally:
            self._deadline = None
            self._unlaunched = False

    def send_forward(self, forward: ForwardInput) -> None:
        """Hand this step's forward to every follower (rank 0 runs it next, then forward_launched())."""
        self._deadline = time.monotonic() + self.step_timeout
        self._unlaunched = True
        self._send_all(forward)

    def forward_launched(self) -> None:
        """Rank 0 has evaluated (or launched the evaluation of) the forward it sent: its collectives run."""
        self._unlaunched = False

    # ---- failure and shutdown ----

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """End the followers: EOF on their pipes (each finishes the step it is in), then a kill after
        timeout_s; at once when the group failed."""
        self._closing.set()
        for follower in self._followers:
            follower.stop(timeout_s if self.failure is None else 0)
        if self._monitor is not None:
            self._monitor.join()
        if self._hostfile is not None:
            self._hostfile.unlink(missing_ok=True)
            self._hostfile = None

    def _send_all(self, message: Any) -> None:
        try:
            for follower in self._followers:
                follower.send(message)
        except (OSError, ValueError) as error:  # BrokenPipeError, or a pipe the monitor closed: a follower is gone
            raise self._fail(f"cannot reach a rank: {type(error).__name__}: {error}") from error

    def _barrier(self) -> None:
        try:
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=self._group))
        except RuntimeError as error:
            raise self._fail(f"tensor-parallel startup failed: {error}") from error

    def _fail(self, reason: str) -> TensorParallelError:
        """Record the group's failure (the first reason wins), kill the followers, tell the engine."""
        with self._lock:
            first = self.failure is None
            if first:
                dead = [f.describe_exit() for f in self._followers if f.exit_status() is not None]
                detail = f" ({'; '.join(dead)})" if dead and not reason.startswith("rank ") else ""
                self.failure = TensorParallelError(f"tensor-parallel group failed: {reason}{detail}")
        if first:
            logger.error("%s; stopping the other ranks", self.failure)
            for follower in self._followers:
                follower.kill()
            if self._on_failure is not None:
                self._on_failure(self.failure)
        return self.failure

    def _wait_for_an_exit(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and all(f.exit_status() is None for f in self._followers):
            time.sleep(0.01)

    def _watch(self) -> None:
        """The monitor thread: a follower that exits, or a collective past its deadline, fails the group."""
        while not self._closing.wait(MONITOR_INTERVAL_S):
            if self.failure is not None:
                return
            dead = next((f for f in self._followers if f.exit_status() is not None), None)
            if self._closing.is_set():  # close() is ending them
                return
            if dead is not None:
                self._fail(dead.describe_exit())
                return
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._fail("a rank stopped responding: a collective did not finish in time "
                           f"(METRALE_TP_STEP_TIMEOUT_S={self.step_timeout:g} s per step)")
                return
