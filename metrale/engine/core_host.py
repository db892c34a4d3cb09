"""LocalCore: the engine core in this process (the model on the MLX thread, its runner, the scheduler and
the step-loop task), as AsyncEngine runs it in-process and as an engine process runs it for its
front-end (metrale.engine.engine_process).

    start()          load the model (rank 0 of a tensor-parallel group when there are several), build the
                     runner, the scheduler and the EngineCore, start the loop; returns the LoadedModel
    submit_group / abort / finish / abort_all     the core's own, on the event-loop thread
    stats()          the core's counters (CoreStats)
    shutdown()       abort what is left, stop the loop, the ranks and the MLX thread
"""

from __future__ import annotations

import asyncio
import logging

from metrale.config import EngineConfig
from metrale.engine.core import EngineCore
from metrale.engine.ipc import CoreStats, ModelFacts, TokenizerSpec
from metrale.engine.mlx_thread import MLXThread
from metrale.engine.runner import ModelRunner
from metrale.engine.startup import Loaded, RunnerFactory, load
from metrale.failpoints import Failpoints
from metrale.loading import LoadedModel
from metrale.models.lora_spec import lora_targets
from metrale.settings import RuntimeSettings
from metrale.speculative.speculator import Speculator

logger = logging.getLogger(__name__)


class LocalCore:
    """Owns the MLX thread, the runner (and the tensor-parallel group), the EngineCore and its loop task.

    `metrics`: what the core records its steps into (EngineMetrics, or an engine process's recorder).
    """

    def __init__(self, config: EngineConfig, settings: RuntimeSettings, metrics, failpoints: Failpoints,
                 speculator: Speculator | None, runner_factory: RunnerFactory | None = None) -> None:
        self.config = config
        self.settings = settings
        self.metrics = metrics
        self.failpoints = failpoints
        self.speculator = speculator
        self.runner_factory = runner_factory if runner_factory is not None else ModelRunner.from_loaded
        self.mlx: MLXThread | None = None
        self.loaded: Loaded | None = None
        self.core: EngineCore | None = None
        self.loop_task: asyncio.Task | None = None
        self.max_model_len = 0

    @property
    def runner(self) -> ModelRunner | None:
        return self.loaded.runner if self.loaded is not None else None

    @property
    def group(self):
        return self.loaded.group if self.loaded is not None else None

    async def start(self) -> LoadedModel:
        """Load the model on the MLX thread (metrale.engine.startup), build the core and start its loop."""
        self.mlx = MLXThread()
        try:
            self.loaded = await load(self.config, self.settings, self.failpoints, self.mlx, self.runner_factory,
                                     self._on_rank_failure)
        except BaseException:
            self.mlx.shutdown()
            raise
        self.max_model_len = self.loaded.max_model_len(self.config)
        self.core = EngineCore(self.loaded.scheduler(self.config), self.loaded.runner, self.mlx, self.metrics,
                               self.failpoints, self.speculator)
        self.loop_task = asyncio.create_task(self.core.run_forever(), name="metrale-engine-loop")
        self.loop_task.add_done_callback(_log_loop_end)
        return self.loaded.model

    def _on_rank_failure(self, error: BaseException) -> None:
        """A rank died or hung (event-loop thread): the engine is dead, every open request ends with an
        error now, and the loop stops (its step in flight may never return from a dead collective)."""
        if self.core is not None and self.core.dead is None:
            self.core.die(error)
        if self.loop_task is not None:
            self.loop_task.cancel()

    def facts(self, loaded: LoadedModel) -> ModelFacts:
        return ModelFacts(model_name=self.runner.model_name, model_path=str(loaded.path),
                          architecture=loaded.config.architecture, vocab_size=loaded.config.vocab_size,
                          max_position_embeddings=loaded.config.max_position_embeddings,
                          dtype_name=self.runner.dtype_name, kv_blocks=self.runner.kv_cache.num_blocks,
                          kv_slots=self.runner.kv_cache.num_slots,
                          has_grammar_compiler=self.runner.grammar_compiler is not None,
                          num_hidden_layers=loaded.config.num_hidden_layers,
                          lora_targets=lora_targets(loaded.config) if self.runner.lora is not None else {},
                          hidden_size=loaded.config.hidden_size)

    def stats(self, check_integrity: bool = False) -> CoreStats:
        """The core's counters; with `check_integrity` (an idle core) the accounting audit's error, if any."""
        core = self.core
        kv = core.scheduler.kv_cache_manager
        integrity_error = None
        if check_integrity:
            try:
                core.scheduler.check_integrity()
            except RuntimeError as error:
                integrity_error = str(error)
        return CoreStats(
            running=core.scheduler.num_running, waiting=core.scheduler.num_waiting, kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks, kv_usage=kv.usage, peak_kv_usage=core.peak_kv_usage,
            num_preemptions=core.scheduler.num_preemptions, num_steps=core.num_steps,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            requests_finished=core.num_finished, num_unfinished=core.num_unfinished, integrity_error=integrity_error)

    # ---- the engine client surface AsyncEngine uses (EngineProcess has the same) ----

    restarting = False  # an in-process engine that dies stays dead

    @property
    def dead(self) -> BaseException | None:
        return self.core.dead if self.core is not None else None

    def set_on_outputs(self, on_outputs) -> None:
        self.core.on_outputs = on_outputs

    def submit_group(self, request_ids, prompt_token_ids, params, *, eos_token_ids, max_tokens, priority,
                     num_open: int, lora=None, pooling=None) -> None:
        self.core.submit_group(request_ids, prompt_token_ids, params, eos_token_ids=eos_token_ids,
                               max_tokens=max_tokens, priority=priority, lora=lora, pooling=pooling)

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def finish(self, request_id, reason, error=None) -> None:
        self.core.finish(request_id, reason, error)

    def abort_all(self) -> None:
        if self.core is not None:
            self.core.abort_all()

    def core_stats(self) -> CoreStats:
        return self.stats()

    def check_integrity(self) -> None:
        self.core.scheduler.check_integrity()

    async def compile(self, spec) -> None:
        await self.runner.grammar_compiler.compile(spec)

    def precompile(self, spec) -> None:
        """Start compiling `spec` now (cached), so that it is ready when its request is scheduled."""
        self.runner.grammar_compiler.submit(spec)

    async def wait_until_dead(self) -> BaseException | None:
        while self.loop_task is None:
            await asyncio.sleep(0.1)
        await asyncio.gather(self.loop_task, return_exceptions=True)
        return self.dead

    async def shutdown(self) -> None:
        """Abort what is left, stop the loop, the ranks and the MLX thread. Leaves nothing running."""
        if self.core is not None:
            self.core.abort_all()  # after the engine died this finds nothing left: die() ended everyone
        if self.loop_task is not None:
            self.loop_task.cancel()
            await asyncio.gather(self.loop_task, return_exceptions=True)
        if self.group is not None:  # the followers finish the step they are in and exit
            await asyncio.to_thread(self.group.close)
        if self.mlx is not None:
            # after a rank failed, the step in flight may wait forever in a collective of the dead ring
            group_failed = self.group is not None and self.group.failure is not None
            await asyncio.to_thread(self.mlx.shutdown, not group_failed)
        if self.runner is not None:
            self.runner.close()


def tokenizer_spec(loaded: LoadedModel) -> TokenizerSpec:
    tokenizer = loaded.tokenizer
    return TokenizerSpec(tokenizer.backend.to_str(), tokenizer.bos_token_id, tokenizer.eos_token_ids,
                         tokenizer.chat_template, tokenizer.pad_token_id)


def _log_loop_end(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("engine loop ended: %r", task.exception())
