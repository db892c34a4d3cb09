"""AsyncEngine: the public, embeddable engine.

    async with AsyncEngine(EngineConfig()) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.text, end="")

Submission (`generate`, `chat`) is synchronous: it tokenizes, validates and queues, raising a typed
rejection (metrale.errors) and changing nothing on bad input. Iterating the returned stream is what
waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Sequence

from prometheus_client import CollectorRegistry, generate_latest

from kvcache.manager import KVCacheManager
from metrale.config import EngineConfig
from metrale.engine.core import EngineCore
from metrale.engine.metrics import EngineMetrics
from metrale.engine.mlx_thread import MLXThread
from metrale.engine.runner import ModelRunner, resolve_dtype
from metrale.engine.stream import RequestStream
from metrale.errors import (EngineDeadError, EngineDrainingError, EngineNotRunningError, EngineUnavailableError,
                            RequestRejectedError)
from metrale.loading import LoadedModel, load_model
from metrale.outputs import CompletionResult, EngineInfo, EngineStats, Usage
from metrale.sampling_params import SamplingParams
from metrale.text.chat_template import ChatTemplate
from metrale.text.processor import InputProcessor, OutputProcessor
from metrale.text.tokenizer import Tokenizer
from scheduler import Scheduler

logger = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192  # cap of the model's own context length when max_model_len is None


def _model_label(model: str | None) -> str:
    """The model_name metric label, known before loading: the file or folder name."""
    if model is None:
        return "SmolLM2-135M-Instruct.Q4_1"
    return Path(model).stem if model.endswith(".gguf") else Path(model).name or model


class AsyncEngine:
    """Continuous-batching engine: many concurrent requests, one batched forward per step."""

    def __init__(self, config: EngineConfig | None = None, *, registry: CollectorRegistry | None = None) -> None:
        self.config = config or EngineConfig()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = EngineMetrics(self.registry, model_name=_model_label(self.config.model))
        self._state = "stopped"  # stopped -> loading -> serving -> draining -> stopped
        self._mlx: MLXThread | None = None
        self._runner: ModelRunner | None = None
        self._core: EngineCore | None = None
        self._inputs: InputProcessor | None = None
        self._outputs: OutputProcessor | None = None
        self._max_model_len = 0  # resolved at start
        self._info: EngineInfo | None = None  # set at start
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ----

    async def start(self) -> "AsyncEngine":
        """Load the model on the MLX thread and start the engine loop."""
        if self._state != "stopped":
            raise RuntimeError(f"engine already {self._state}")
        self._state = "loading"
        self._loop = asyncio.get_running_loop()
        self._mlx = MLXThread()
        try:
            loaded = await self._mlx.run(load_model, self.config.model, dtype=resolve_dtype(self.config.dtype))
            self._runner = await self._mlx.run(ModelRunner.from_loaded, loaded, self.config)
        except BaseException:
            self._mlx.shutdown()
            self._state = "stopped"
            raise
        self._init_text(loaded)
        self._info = EngineInfo(model_path=str(loaded.path), model_type=loaded.config.architecture,
                                dtype=self._runner.dtype_name, kv_block_size=self.config.block_size)
        self._max_model_len = self.config.max_model_len or min(
            loaded.config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        self.metrics.set_max_model_len(self._max_model_len)
        self._core = EngineCore(self._build_scheduler(), self._runner, self._mlx, self.metrics)
        self.metrics.set_info(model=self.model_name, dtype=self._runner.dtype_name,
                              kv_blocks=str(self._runner.kv_cache.num_blocks),
                              block_size=str(self.config.block_size))
        self._loop_task = asyncio.create_task(self._core.run_forever(), name="metrale-engine-loop")
        self._loop_task.add_done_callback(self._on_loop_done)
        self._state = "serving"
        logger.info("engine serving %s: %d KV blocks of %d tokens, max_model_len %d", self.model_name,
                    self._runner.kv_cache.num_blocks, self.config.block_size, self._max_model_len)
        return self

    def _init_text(self, loaded: LoadedModel) -> None:
        template = ChatTemplate.for_tokenizer(loaded.tokenizer, loaded.config.architecture)
        self._inputs = InputProcessor(loaded.tokenizer, template, loaded.config.vocab_size)
        self._outputs = OutputProcessor(loaded.tokenizer)

    def _build_scheduler(self) -> Scheduler:
        scheduler_config = dataclasses.replace(self.config.scheduler, max_model_len=self._max_model_len)
        kv = KVCacheManager(num_blocks=self._runner.kv_cache.num_blocks, block_size=scheduler_config.block_size,
                            enable_prefix_caching=scheduler_config.enable_prefix_caching)
        return Scheduler(scheduler_config, kv)

    def _on_loop_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("engine loop ended: %r", task.exception())

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting requests, let in-flight ones finish for up to timeout_s, abort the rest."""
        if self._core is None:
            return
        self._state = "draining"
        deadline = time.monotonic() + timeout_s
        while self._core.num_unfinished and time.monotonic() < deadline and self._core.dead is None:
            await asyncio.sleep(0.02)
        if self._core.num_unfinished:
            logger.warning("drain timeout: aborting %d requests", self._core.num_unfinished)
            self._core.abort_all()

    async def shutdown(self) -> None:
        """Abort what is left, stop the loop and the MLX thread. Leaves nothing running."""
        if self._state == "stopped":
            return
        if self._core is not None and self._core.dead is None:
            self._core.abort_all()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._mlx is not None:
            await asyncio.to_thread(self._mlx.shutdown)
        self._state = "stopped"

    async def __aenter__(self) -> "AsyncEngine":
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # ---- submission ----

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 request_id: str | None = None, priority: int = 0) -> RequestStream:
        """Queue a request and return its stream. Raises a RequestRejectedError (bad input, too long,
        queue full, duplicate id) or an EngineUnavailableError (not running, draining, dead); nothing
        is queued then."""
        with self._counting_rejections():
            inputs = self._accepting()
            params = _checked_params(params)
            return self._submit(inputs.prompt_ids(prompt), params, request_id, priority)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
             request_id: str | None = None, priority: int = 0) -> RequestStream:
        """Render the model's chat template over messages, then `generate` from it."""
        with self._counting_rejections():
            inputs = self._accepting()
            params = _checked_params(params)
            return self._submit(inputs.chat_ids(messages), params, request_id, priority)

    async def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0) -> CompletionResult:
        """Run a request to the end and return its whole result (raises RequestFailedError on error)."""
        async with self.generate(prompt, params, request_id=request_id, priority=priority) as stream:
            text, token_ids, logprobs = [], [], []
            finish_reason, num_prompt = "abort", 0
            async for out in stream:
                text.append(out.text)
                token_ids.extend(out.token_ids)
                if out.logprobs:
                    logprobs.extend(out.logprobs)
                finish_reason, num_prompt = out.finish_reason or finish_reason, out.num_prompt_tokens
        return CompletionResult(request_id=stream.request_id, text="".join(text), token_ids=token_ids,
                                finish_reason=finish_reason, usage=Usage(num_prompt, len(token_ids)),
                                logprobs=logprobs or None)

    def abort(self, request_id: str) -> bool:
        """Abort a request (sync). Its stream ends with finish_reason "abort" at the next step
        boundary, where its blocks are freed. On the engine's event loop: False when the id is
        unknown or already finished. From another thread the abort is handed to the loop and True
        means only that it was handed over."""
        if self._core is None or self._loop is None or self._loop.is_closed():
            return False
        try:
            running_loop = asyncio.get_running_loop()
        except RuntimeError:
            running_loop = None
        if running_loop is not self._loop:  # e.g. a stream collected on another thread
            self._loop.call_soon_threadsafe(self._core.abort, request_id)
            return True
        return self._core.abort(request_id)

    @contextlib.contextmanager
    def _counting_rejections(self) -> Iterator[None]:
        """Every refusal at submit time is counted once, by the reason its type carries."""
        try:
            yield
        except (RequestRejectedError, EngineUnavailableError) as error:
            if error.reason is not None:
                self.metrics.record_rejected(error.reason)
            raise
        except (ValueError, TypeError):  # e.g. params that are not SamplingParams
            self.metrics.record_rejected("invalid_request")
            raise

    def _accepting(self) -> InputProcessor:
        if self._state == "draining":
            raise EngineDrainingError("engine is draining for shutdown; not accepting requests")
        if self._state != "serving" or self._inputs is None or self._core is None:
            raise EngineNotRunningError(f"engine is {self._state}; call start() first")
        if self._core.dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self._core.dead!r}")
        return self._inputs

    def _submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None,
                priority: int) -> RequestStream:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        channel = self._core.submit(request_id, prompt_ids, params, self._outputs.new_request(prompt_ids, params),
                                    eos_token_ids=self._inputs.tokenizer.eos_token_ids, priority=priority)
        return RequestStream(channel, self.abort)

    # ---- introspection (metrale.engine.protocol.EngineClient) ----

    @property
    def model_name(self) -> str:
        return self._runner.model_name if self._runner is not None else _model_label(self.config.model)

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens a request may hold; 0 until the engine has started."""
        return self._max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (for counting tokens, building prompts)."""
        if self._inputs is None:
            raise EngineNotRunningError("engine not started")
        return self._inputs.tokenizer

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (the width of its logits)."""
        if self._inputs is None:
            raise EngineNotRunningError("engine not started")
        return self._inputs.vocab_size

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([token_id]) for token_id in token_ids]

    def record_rejected(self, reason: str) -> None:
        self.metrics.record_rejected(reason)

    def metrics_exposition(self) -> bytes:
        return generate_latest(self.registry)

    def health(self) -> str:
        """"loading" | "serving" | "draining" | "unhealthy" | "stopped"."""
        if self._core is not None and self._core.dead is not None:
            return "unhealthy"
        return self._state

    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineNotRunningError("engine not started")
        return self._info

    def stats(self) -> EngineStats:
        core = self._core
        if core is None:
            raise EngineNotRunningError("engine not started")
        kv = core.scheduler.kv_cache_manager
        return EngineStats(
            health=self.health(), running=core.scheduler.num_running, waiting=core.scheduler.num_waiting,
            kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_free_blocks, kv_usage=kv.usage,
            peak_kv_usage=core.peak_kv_usage, num_preemptions=core.scheduler.num_preemptions,
            num_steps=core.num_steps, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, requests_finished=core.num_finished)

    def check_integrity(self) -> None:
        """Raise if the KV accounting is inconsistent (tests call this after every scenario)."""
        if self._core is None:
            raise EngineNotRunningError("engine not started")
        self._core.scheduler.check_integrity()


def _checked_params(params: SamplingParams | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    return params
