"""EngineProcess: the front-end's handle on an engine process (metrale.engine.engine_process), supervised.

The child is `python -m metrale.engine.engine_process` with two pipes: msgspec frames go down its stdin,
its Outputs come up its stdout (metrale.engine.ipc). A pipe, not ZMQ: one peer, ordered, no new
dependency, and the end of the pipe is the death notice both ways (the child stops when the front-end
goes; the front-end reads EOF the moment the child dies, whatever killed it).

When the child dies (SIGSEGV in a kernel or in llguidance, an OOM kill, SIGKILL, its loop failing):
every open request ends with an error (`on_death`), new submissions raise EngineRestartingError (503
with Retry-After) while a new child starts with the same config after a backoff, and `metrale_engine_
restarts_total` counts it. More than `max_restarts` deaths within RESTART_WINDOW_S is final: `dead`
is set and `wait_until_dead` returns it (`metrale serve` then exits 1).

A child that is alive but hung (stopped, stuck in a native call) closes nothing: the hang watch
(metrale.engine.hang_watch) notices its missing heartbeat or its stuck step within `hang_timeout_s`, kills it
(`metrale_engine_hangs_total` counts it), and the death above follows: the same errors, the same restart.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence

import msgspec

from kvcache.manager import KVCacheManager
from metrale.config import EngineConfig
from metrale.engine import ipc
from metrale.engine.hang_watch import CHECK_INTERVAL_S, HangWatch
from metrale.engine.metrics import EngineMetrics
from metrale.engine.step import EngineOutput, RowError
from metrale.pooling_params import PoolingParams
from metrale.errors import (EngineDeadError, EngineRestartingError, InvalidStructuredOutputError, QueueFullError)
from metrale.sampling_params import SamplingParams
from metrale.structured_outputs import StructuredOutputs
from scheduler import FinishReason, LoraRef, Request
from scheduler.admission import check_admissible, check_forks

logger = logging.getLogger(__name__)
RESTART_WINDOW_S = 600.0
BACKOFF_S = (0.2, 1.0, 2.0, 5.0, 10.0)  # before the 1st, 2nd, ... restart in a window
STOP_TIMEOUT_S = 10.0


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "it closed its pipe"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class EngineProcess:
    """Starts, talks to and restarts the engine process; see the module docstring."""

    def __init__(self, config: EngineConfig, metrics: EngineMetrics, max_restarts: int,
                 hang_timeout_s: float = 300.0) -> None:
        self.config = config
        self.metrics = metrics
        self.max_restarts = max_restarts
        self.hang_timeout_s = hang_timeout_s
        self.on_outputs: Callable[[list[EngineOutput]], None] | None = None
        self.on_death: Callable[[BaseException], None] | None = None  # every open request ends with this error
        self.dead: BaseException | None = None  # final: no more restarts
        self.restarting = False
        self.stats = ipc.CoreStats()
        self.facts: ipc.ModelFacts | None = None
        self.max_model_len = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._hang: str | None = None  # why the hang watch killed the current child
        self._deaths: collections.deque[float] = collections.deque()
        self._compiles: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._closing = False
        self._ended = asyncio.Event()  # dead or shut down
        self._kv_shadow: KVCacheManager | None = None  # the child's pool size, for admission checks here
        self._scheduler_config = config.scheduler

    # ---- lifecycle ----

    async def start(self) -> ipc.Ready:
        """Start the child and wait until its model is loaded (RuntimeError if it cannot start)."""
        ready = await self._spawn()
        self.facts, self.max_model_len = ready.facts, ready.max_model_len
        self._kv_shadow = KVCacheManager(num_blocks=ready.facts.kv_blocks, block_size=self.config.block_size,
                                         enable_prefix_caching=False)
        self._scheduler_config = dataclasses.replace(self.config.scheduler, max_model_len=self.max_model_len)
        return ready

    async def _spawn(self) -> ipc.Ready:
        level = logging.getLevelName(logging.getLogger("metrale").getEffectiveLevel())
        proc = await asyncio.create_subprocess_exec(  # the child logs at the front-end's level
            sys.executable, "-m", "metrale.engine.engine_process", level, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=ipc.MAX_FRAME_BYTES)
        self._proc = proc
        proc.stdin.write(ipc.frame(ipc.Start(msgspec.to_builtins(self.config))))
        try:
            message = await self._read(proc)
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            await proc.wait()
            raise RuntimeError(f"the engine process failed to start ({describe_exit(proc.returncode)})") from error
        if isinstance(message, ipc.StartFailed):
            await proc.wait()
            raise RuntimeError(f"the engine process failed to start: {message.kind}: {message.message}")
        if not isinstance(message, ipc.Ready):
            raise RuntimeError(f"the engine process said {type(message).__name__} before Ready")
        self.stats = message.stats
        watch = HangWatch(self.hang_timeout_s, time.monotonic())
        self._reader = asyncio.create_task(self._read_loop(proc, watch), name="metrale-engine-outputs")
        self._watchdog = asyncio.create_task(self._watch(proc, watch), name="metrale-engine-hang-watch")
        logger.info("engine process %d serving", proc.pid)
        return message

    @staticmethod
    async def _read(proc: asyncio.subprocess.Process):
        header = await proc.stdout.readexactly(ipc.HEADER.size)
        return ipc.TO_FRONT.decode(await proc.stdout.readexactly(ipc.body_length(header)))

    async def _read_loop(self, proc: asyncio.subprocess.Process, watch: HangWatch) -> None:
        try:
            while True:
                message = await self._read(proc)
                watch.frame(message, time.monotonic())
                self._dispatch(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:  # a frame this side cannot handle: the pipe cannot be trusted any more
            logger.exception("engine process %d: bad frame; stopping it", proc.pid)
            proc.kill()
        await proc.wait()
        if not self._closing:
            await self._on_exit(proc)

    async def _watch(self, proc: asyncio.subprocess.Process, watch: HangWatch) -> None:
        """Kill the child when the hang watch says it is hung; its reader then sees it die (`_on_exit`)."""
        while proc.returncode is None and not self._closing:
            await asyncio.sleep(CHECK_INTERVAL_S)
            reason = watch.check(time.monotonic())
            if reason is not None and proc.returncode is None and not self._closing:
                self._hang = reason
                logger.error("engine process %d hung: %s; killing it", proc.pid, reason)
                self.metrics.record_engine_hang()
                proc.kill()
                return

    def _dispatch(self, message) -> None:
        if isinstance(message, ipc.Outputs):
            self.stats = message.stats
            if message.metrics is not None:
                self._record(message.metrics)
            if message.outputs and self.on_outputs is not None:
                self.on_outputs(message.outputs)
        elif isinstance(message, ipc.Compiled):
            future = self._compiles.pop(message.call_id, None)
            if future is not None and not future.done():
                future.set_result(message.error)

    def _record(self, samples: ipc.MetricSamples) -> None:
        for stats in samples.iterations:
            self.metrics.record_iteration(stats)
        for stats in samples.finished:
            self.metrics.record_finished(stats)
        for verification in samples.speculation:
            self.metrics.record_speculation(**dataclasses.asdict(verification))
        if samples.gauges is not None:
            self.metrics.set_gauges(*samples.gauges)

    async def _on_exit(self, proc: asyncio.subprocess.Process) -> None:
        """The child died: end what was open, then restart it (or give up)."""
        hang, self._hang = self._hang, None
        cause = describe_exit(proc.returncode) if hang is None else f"hung: {hang}; {describe_exit(proc.returncode)}"
        error = EngineDeadError(f"the engine process died ({cause})")
        logger.error("%s; %d requests in flight end with an error", error, self.stats.num_unfinished)
        self.restarting = True
        self.stats = ipc.CoreStats(kv_blocks_total=self.stats.kv_blocks_total,
                                   kv_blocks_free=self.stats.kv_blocks_total)
        self.metrics.set_gauges(0, 0, 0.0)  # nothing runs until the next engine process does
        for future in self._compiles.values():
            if not future.done():
                future.set_exception(error)
        self._compiles.clear()
        if self.on_death is not None:
            self.on_death(error)
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > RESTART_WINDOW_S:
            self._deaths.popleft()
        while not self._closing:
            if len(self._deaths) > self.max_restarts:
                self.dead = EngineDeadError(f"{error}; {len(self._deaths)} deaths within {RESTART_WINDOW_S:.0f} s "
                                            f"exhaust the restart budget ({self.max_restarts})")
                logger.critical("%s", self.dead)
                self.restarting = False
                self._ended.set()
                return
            await asyncio.sleep(BACKOFF_S[min(len(self._deaths), len(BACKOFF_S)) - 1])
            try:
                await self._spawn()
            except RuntimeError as failure:
                logger.error("restarting the engine process failed: %s", failure)
                self._deaths.append(time.monotonic())
                continue
            self.metrics.record_engine_restart()
            self.restarting = False
            return

    async def shutdown(self) -> None:
        """End the child: EOF on its stdin (it aborts what is left and exits), then a kill after a timeout.
        A restart under way when this is called is waited for, and its child ended too."""
        self._closing = True
        while True:
            proc, reader = self._proc, self._reader
            if self._watchdog is not None:
                self._watchdog.cancel()
                await asyncio.wait([self._watchdog])
            if proc is not None and proc.returncode is None:
                proc.stdin.close()
                try:
                    await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
                except asyncio.TimeoutError:
                    logger.warning("engine process %d did not stop in %.0f s; killing it", proc.pid, STOP_TIMEOUT_S)
                    proc.kill()
                    await proc.wait()
            if reader is not None:
                await asyncio.gather(reader, return_exceptions=True)
            if (self._proc, self._reader) == (proc, reader):
                break
        self._ended.set()

    async def wait_until_dead(self) -> BaseException | None:
        """Wait until the restart budget is spent (the final error) or the engine is shut down (None)."""
        await self._ended.wait()
        return self.dead

    # ---- requests (event-loop thread) ----

    def set_on_outputs(self, on_outputs: Callable[[list[EngineOutput]], None]) -> None:
        self.on_outputs = on_outputs

    def core_stats(self) -> ipc.CoreStats:
        """The child's counters as of its last frame."""
        return self.stats

    def check_integrity(self) -> None:
        """The child audits its accounting whenever it goes idle; its last finding, raised here."""
        if self.stats.integrity_error is not None:
            raise RuntimeError(f"engine process: {self.stats.integrity_error}")

    def precompile(self, spec: StructuredOutputs) -> None:
        """Nothing ahead of time here: the child compiles a request's grammar when it is submitted."""

    def _send(self, message) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        if self.restarting or self._proc is None or self._proc.returncode is not None:
            raise EngineRestartingError("the engine process is restarting; retry shortly")
        self._proc.stdin.write(ipc.frame(message))

    def submit_group(self, request_ids: Sequence[str], prompt_token_ids: list[int], params: Sequence[SamplingParams],
                     *, eos_token_ids: tuple[int, ...], max_tokens: int, priority: int, num_open: int,
                     lora: LoraRef | None = None, pooling: PoolingParams | None = None) -> None:
        """Check what the child's scheduler would refuse (its typed rejections, raised here), then send.
        `pooling`: an embedding request (one id), pooled instead of sampled."""
        requests = [Request(rid, prompt_token_ids, max_tokens=max_tokens, eos_token_ids=eos_token_ids,
                            min_tokens=p.min_tokens, priority=priority, lora=lora) for rid, p in zip(request_ids, params)]
        for request in requests:
            check_admissible(request, self._scheduler_config, self._kv_shadow)
        check_forks(requests[0], requests[1:], self._scheduler_config)
        if num_open - self.stats.running >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests); "
                                 f"request {request_ids[0]!r} rejected")
        self._send(ipc.Add(list(request_ids), prompt_token_ids, list(params), eos_token_ids, max_tokens, priority,
                           lora, pooling))

    def abort(self, request_id: str) -> bool:
        """Hand the abort to the child: True means only that it was sent (as from another thread in-process)."""
        if self.restarting or self.dead is not None:
            return False
        self._send(ipc.Abort(request_id))
        return True

    def finish(self, request_id: str, reason: FinishReason, error: RowError | None = None) -> None:
        if not self.restarting and self.dead is None:
            self._send(ipc.Finish(request_id, reason, error))

    def abort_all(self) -> None:
        if not self.restarting and self.dead is None and self._proc is not None and self._proc.returncode is None:
            self._send(ipc.AbortAll())

    async def compile(self, spec: StructuredOutputs) -> None:
        """Compile a structured-output constraint in the child (InvalidStructuredOutputError if it is bad)."""
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._compiles[call_id] = future
        self._send(ipc.Compile(call_id, spec))
        error = await future
        if error is not None:
            raise InvalidStructuredOutputError(error.message)

