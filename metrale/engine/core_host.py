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
import dataclasses
import logging
from typing import TYPE_CHECKING

from kvcache.manager import KVCacheManager
from metrale.config import EngineConfig
from metrale.engine.core import EngineCore
from metrale.engine.ipc import CoreStats, ModelFacts, TokenizerSpec
from metrale.engine.mlx_thread import MLXThread
from metrale.engine.runner import ModelRunner, weights_dtype
from metrale.failpoints import Failpoints
from metrale.loading import LoadedModel, load_model
from metrale.speculative.speculator import Speculator
from scheduler import Scheduler

if TYPE_CHECKING:  # imported by _start_ranks: a one-rank engine never loads metrale.distributed
    from metrale.distributed.group import TensorParallelGroup

logger = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192  # cap of the model's own context length when max_model_len is None


class LocalCore:
    """Owns the MLX thread, the runner (and the tensor-parallel group), the EngineCore and its loop task.

    `metrics`: what the core records its steps into (EngineMetrics, or an engine process's recorder).
    """

    def __init__(self, config: EngineConfig, metrics, failpoints: Failpoints, speculator: Speculator | None) -> None:
        self.config = config
        self.metrics = metrics
        self.failpoints = failpoints
        self.speculator = speculator
        self.mlx: MLXThread | None = None
        self.runner: ModelRunner | None = None
        self.group: TensorParallelGroup | None = None
        self.core: EngineCore | None = None
        self.loop_task: asyncio.Task | None = None
        self.max_model_len = 0

    async def start(self) -> LoadedModel:
        """Load the model on the MLX thread, build the core and start its loop."""
        self.mlx = MLXThread()
        try:
            if self.config.tensor_parallel_size > 1:
                loaded = await self._start_ranks()
            else:
                loaded = await self.mlx.run(load_model, self.config.model, dtype=weights_dtype(self.config.dtype))
                self.runner = await self.mlx.run(ModelRunner.from_loaded, loaded, self.config, self.failpoints)
        except BaseException:
            if self.group is not None:
                self.group.close(timeout_s=0)
            self.mlx.shutdown()
            raise
        self.max_model_len = self.config.max_model_len or min(
            loaded.config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        self.core = EngineCore(self._build_scheduler(), self.runner, self.mlx, self.metrics, self.failpoints,
                               self.speculator)
        self.loop_task = asyncio.create_task(self.core.run_forever(), name="metrale-engine-loop")
        self.loop_task.add_done_callback(_log_loop_end)
        return loaded

    async def _start_ranks(self) -> LoadedModel:
        """Tensor parallelism: start ranks 1..N-1, join the ring, load this rank's share of the model
        and its runner, and wait for every rank at the startup barrier."""
        from metrale.distributed.group import TensorParallelGroup

        loop = asyncio.get_running_loop()
        dtype = weights_dtype(self.config.dtype)
        self.group = TensorParallelGroup(
            self.config.tensor_parallel_size,
            on_failure=lambda error: loop.call_soon_threadsafe(self._on_rank_failure, error))
        self.group.spawn(self.config.model, dtype)  # from the event-loop thread, which outlives the ranks
        await self.group.wait_joining()
        await self.mlx.run(self.group.join)
        loaded = await self.mlx.run(load_model, self.config.model, dtype=dtype, shard=self.group.shard)
        self.runner = await self.mlx.run(ModelRunner.from_loaded, loaded, self.config, self.failpoints, self.group)
        await self.mlx.run(self.group.start_steps, self.runner.kv_cache.num_blocks, self.config.block_size)
        logger.info("tensor parallel: %d ranks, each with its share of the heads and MLP and its own KV pools",
                    self.config.tensor_parallel_size)
        return loaded

    def _on_rank_failure(self, error: BaseException) -> None:
        """A rank died or hung (event-loop thread): the engine is dead, every open request ends with an
        error now, and the loop stops (its step in flight may never return from a dead collective)."""
        if self.core is not None and self.core.dead is None:
            self.core.die(error)
        if self.loop_task is not None:
            self.loop_task.cancel()

    def _build_scheduler(self) -> Scheduler:
        scheduler_config = dataclasses.replace(self.config.scheduler, max_model_len=self.max_model_len)
        kv = KVCacheManager(num_blocks=self.runner.kv_cache.num_blocks, block_size=scheduler_config.block_size,
                            enable_prefix_caching=scheduler_config.enable_prefix_caching)
        return Scheduler(scheduler_config, kv)

    def facts(self, loaded: LoadedModel) -> ModelFacts:
        return ModelFacts(model_name=self.runner.model_name, model_path=str(loaded.path),
                          architecture=loaded.config.architecture, vocab_size=loaded.config.vocab_size,
                          max_position_embeddings=loaded.config.max_position_embeddings,
                          dtype_name=self.runner.dtype_name, kv_blocks=self.runner.kv_cache.num_blocks,
                          kv_slots=self.runner.kv_cache.num_slots,
                          has_grammar_compiler=self.runner.grammar_compiler is not None)

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
                     num_open: int) -> None:
        self.core.submit_group(request_ids, prompt_token_ids, params, eos_token_ids=eos_token_ids,
                               max_tokens=max_tokens, priority=priority)

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
