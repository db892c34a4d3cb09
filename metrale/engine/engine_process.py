"""The engine process: `python -m metrale.engine.engine_process`, started and supervised by the front-end
(metrale.engine.engine_client). It holds the scheduler, the runner, the kernels and the grammar compiler;
a native crash here (a kernel, llguidance, an OOM kill) ends this process only.

    stdin   frames from the front-end (metrale.engine.ipc): Start, then Add | Abort | Finish | AbortAll | Compile
    stdout  frames to it: Ready (or StartFailed), then Outputs per step | Compiled | Heartbeat (every
            HEARTBEAT_INTERVAL_S, from the event loop, with the age of the step in flight: a child that stops
            beating, or whose step runs far too long, is killed and restarted: metrale.engine.hang_watch)
    stderr  logs (stray prints go there too: stdout is the frame channel)

The end of stdin (the front-end closed it, or died) shuts the engine down. The loop dying (the core
could make no progress) exits with status 1, so that the front-end restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, BinaryIO

from metrale.config import EngineConfig
from metrale.engine import ipc
from metrale.engine.core_host import LocalCore, tokenizer_spec
from metrale.engine.metrics import FinishedRequestStats, IterationStats
from metrale.engine.step import EngineOutput, RowError
from metrale.errors import RequestRejectedError
from metrale.failpoints import Failpoints
from metrale.settings import RuntimeSettings
from metrale.speculative.config import SpeculativeConfig
from metrale.speculative.speculator import Speculator, Verification
from scheduler import FinishReason, SchedulerConfig

logger = logging.getLogger("metrale.engine.engine_process")


class MetricsRecorder:
    """Stands for EngineMetrics in the engine process: keeps the core's calls for the next frame."""

    def __init__(self) -> None:
        self._samples = ipc.MetricSamples()

    def record_iteration(self, stats: IterationStats) -> None:
        self._samples.iterations.append(stats)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        self._samples.finished.append(stats)

    def record_speculation(self, **counts: Any) -> None:
        self._samples.speculation.append(Verification(**counts))

    def set_gauges(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        self._samples.gauges = (num_running, num_waiting, kv_cache_usage)

    def take(self) -> ipc.MetricSamples | None:
        samples = self._samples
        if not (samples.iterations or samples.finished or samples.speculation or samples.gauges is not None):
            return None
        self._samples = ipc.MetricSamples()
        return samples


def config_from_builtins(values: dict) -> EngineConfig:
    """The EngineConfig the front-end sent (msgspec.to_builtins of it)."""
    values = dict(values)
    scheduler = SchedulerConfig(**values.pop("scheduler"))
    spec = values.pop("speculative_config", None)
    return EngineConfig(scheduler=scheduler, speculative_config=SpeculativeConfig.parse(spec), **values)


def read_frame(stream: BinaryIO, decoder) -> Any | None:
    """The next message, or None at the end of the stream."""
    header = stream.read(ipc.HEADER.size)
    if len(header) < ipc.HEADER.size:
        return None
    length = ipc.body_length(header)
    body = stream.read(length)
    if len(body) < length:
        return None
    return decoder.decode(body)


class EngineServer:
    """The engine side of the pipe: applies the front-end's messages to a LocalCore, sends its outputs."""

    def __init__(self, config: EngineConfig, out: BinaryIO) -> None:
        self.config = config
        self.out = out
        self.recorder = MetricsRecorder()
        speculator = Speculator(config.speculative_config) if config.speculative_config is not None else None
        settings = RuntimeSettings.resolve(config)  # this process's environment is the front-end's
        self.host = LocalCore(config, settings, self.recorder, Failpoints.from_spec(settings.failpoints, seed=config.seed),
                              speculator)
        self.stopped = asyncio.Event()

    def send(self, message) -> None:
        self.out.write(ipc.frame(message))

    def send_outputs(self, outputs: list[EngineOutput]) -> None:
        core = self.host.core
        self.send(ipc.Outputs(outputs, self.host.stats(check_integrity=not core.num_unfinished), self.recorder.take()))

    def handle(self, message) -> None:
        """One message from the front-end (event-loop thread)."""
        core = self.host.core
        if isinstance(message, ipc.Add):
            try:
                core.submit_group(message.request_ids, message.prompt_token_ids, message.params,
                                  eos_token_ids=message.eos_token_ids, max_tokens=message.max_tokens,
                                  priority=message.priority, lora=message.lora, pooling=message.pooling)
            except (RequestRejectedError, ValueError, TypeError) as error:  # the front-end checked; a race
                self.send_outputs([EngineOutput(rid, finish_reason=FinishReason.ERROR, error=RowError.of(error))
                                   for rid in message.request_ids])
                return
        elif isinstance(message, ipc.Abort):
            core.abort(message.request_id)
        elif isinstance(message, ipc.Finish):
            core.finish(message.request_id, message.reason, message.error)
        elif isinstance(message, ipc.AbortAll):
            core.abort_all()
        elif isinstance(message, ipc.Compile):
            asyncio.create_task(self._compile(message))
            return
        self.send_outputs([])  # fresh counters for the front-end's stats()

    async def _compile(self, message: ipc.Compile) -> None:
        compiler = self.host.runner.grammar_compiler
        error = None
        try:
            await compiler.compile(message.spec)
        except Exception as failure:  # noqa: BLE001  (sent back: the caller raises it)
            error = RowError.of(failure)
        self.send(ipc.Compiled(message.call_id, error))

    async def beat(self) -> None:
        """A Heartbeat every HEARTBEAT_INTERVAL_S while the event loop runs (the front-end's hang watch)."""
        core = self.host.core
        while True:
            await asyncio.sleep(ipc.HEARTBEAT_INTERVAL_S)
            started = core.step_started
            try:
                self.send(ipc.Heartbeat(None if started is None else time.monotonic() - started, core.mean_step_s))
            except BrokenPipeError:  # the front-end is gone: the end of stdin stops this process next
                logger.warning("the front-end closed the pipe; heartbeats stop")
                return

    def read_inbox(self, inbox: BinaryIO, loop: asyncio.AbstractEventLoop) -> None:
        """The reader thread: every message to the loop; the end of stdin stops the engine."""
        try:
            while (message := read_frame(inbox, ipc.TO_ENGINE)) is not None:
                loop.call_soon_threadsafe(self.handle, message)
        finally:
            loop.call_soon_threadsafe(self.stopped.set)

    async def serve(self, inbox: BinaryIO) -> int:
        try:
            loaded = await self.host.start()
        except Exception as error:  # noqa: BLE001  (reported to the front-end, which gives up)
            logger.exception("engine failed to start")
            self.send(ipc.StartFailed(type(error).__name__, str(error)))
            return 2
        self.host.core.on_outputs = self.send_outputs
        self.send(ipc.Ready(self.host.facts(loaded), tokenizer_spec(loaded), self.host.max_model_len,
                            self.host.stats()))
        loop = asyncio.get_running_loop()
        threading.Thread(target=self.read_inbox, args=(inbox, loop), name="metrale-engine-inbox", daemon=True).start()
        stop = asyncio.create_task(self.stopped.wait())
        heartbeat = asyncio.create_task(self.beat(), name="metrale-engine-heartbeat")
        await asyncio.wait([stop, self.host.loop_task], return_when=asyncio.FIRST_COMPLETED)
        died = self.host.loop_task.done() and not self.host.loop_task.cancelled()
        stop.cancel()
        heartbeat.cancel()
        await asyncio.wait([heartbeat])
        await self.host.shutdown()
        return 1 if died else 0


def main() -> None:
    # The front-end decides when the engine stops (the end of stdin): a Ctrl-C or SIGTERM sent to the whole
    # process group must not kill the engine under a draining server.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints go to stderr: stdout carries the frames
    logging.basicConfig(level=sys.argv[1] if len(sys.argv) > 1 else "WARNING",  # the front-end's level
                        format="%(asctime)s %(levelname)s engine %(name)s: %(message)s")
    inbox = sys.stdin.buffer
    status = 0
    start = read_frame(inbox, ipc.TO_ENGINE)
    if isinstance(start, ipc.Start):
        server = EngineServer(config_from_builtins(start.config), out)
        status = asyncio.run(server.serve(inbox))
    logging.shutdown()
    sys.stderr.flush()
    # No interpreter teardown: nothing is left to run, and a native thread's thread_local destructor racing
    # it once aborted the process (the MLX thread's random key: kernels.runtime.release_thread_state)
    os._exit(status)


if __name__ == "__main__":
    main()
