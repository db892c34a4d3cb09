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
import functools
import itertools
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from prometheus_client import CollectorRegistry, generate_latest

from kvcache.manager import KVCacheManager
from metrale.config import EngineConfig
from metrale.engine.core import EngineCore
from metrale.engine.metrics import EngineMetrics
from metrale.engine.mlx_thread import MLXThread
from metrale.engine.runner import ModelRunner, weights_dtype
from metrale.engine.stream import GroupStream, OutputChannel, RequestStream
from metrale.errors import (EngineDeadError, EngineDrainingError, EngineNotRunningError, EngineUnavailableError,
                            PromptTooLongError, RequestRejectedError, StructuredOutputUnavailableError)
from metrale.failpoints import Failpoints
from metrale.loading import LoadedModel, load_model
from metrale.outputs import CompletionResult, EngineInfo, EngineState, EngineStats
from metrale.sampling.guided import GrammarCompiler, require_llguidance
from metrale.sampling_params import SamplingParams
from metrale.speculative.proposers import HostProposer
from metrale.speculative.speculator import Speculator
from metrale.text.chat_template import ChatTemplate
from metrale.text.processor import InputProcessor, OutputProcessor
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_parsers import detect_format
from scheduler import Scheduler

if TYPE_CHECKING:  # imported by _start_ranks: a one-rank engine never loads metrale.distributed
    from metrale.distributed.group import TensorParallelGroup

logger = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192  # cap of the model's own context length when max_model_len is None
WATCHDOG_MIN_S = 60.0  # a step running longer than this and WATCHDOG_FACTOR x the mean step is stuck
WATCHDOG_FACTOR = 50.0
OFF_LOOP_PROMPT_CHARS = 16 * 1024  # longer prompts are tokenized on a worker thread (async paths)


def _model_label(model: str | None) -> str:
    """The model_name metric label, known before loading: the file or folder name."""
    if model is None:
        return "SmolLM2-135M-Instruct.Q4_1"
    return Path(model).stem if model.endswith(".gguf") else Path(model).name or model


class AsyncEngine:
    """Continuous-batching engine: many concurrent requests, one batched forward per step."""

    def __init__(self, config: EngineConfig | None = None, *, registry: CollectorRegistry | None = None,
                 proposer: HostProposer | None = None) -> None:
        """`proposer`: a host-side draft proposer to speculate with instead of the configured method's
        (metrale.speculative.proposers; needs a speculative_config for num_speculative_tokens and the policy)."""
        self.config = config or EngineConfig()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = EngineMetrics(self.registry, model_name=_model_label(self.config.model))
        self._state = EngineState.STOPPED  # stopped -> loading -> serving -> draining -> stopped
        self._mlx: MLXThread | None = None
        self._runner: ModelRunner | None = None
        self._group: TensorParallelGroup | None = None  # rank 0's handle on the other ranks (tensor parallelism)
        self._core: EngineCore | None = None
        self._inputs: InputProcessor | None = None
        self._outputs: OutputProcessor | None = None
        self._max_model_len = 0  # resolved at start
        self._info: EngineInfo | None = None  # set at start
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failpoints = Failpoints.from_env(self.config.failpoints, seed=self.config.seed)
        spec = self.config.speculative_config
        if proposer is not None and spec is None:
            raise ValueError("a proposer needs EngineConfig(speculative_config=...): how many drafts, and when")
        self._speculator = Speculator(spec, proposer) if spec is not None else None
        if spec is not None:
            self.metrics.enable_speculation(spec.num_speculative_tokens)
        self._tokenize_thread: ThreadPoolExecutor | None = None

    # ---- lifecycle ----

    async def start(self) -> "AsyncEngine":
        """Load the model on the MLX thread and start the engine loop."""
        if self._state is not EngineState.STOPPED:
            raise RuntimeError(f"engine already {self._state}")
        self._state = EngineState.LOADING
        self._loop = asyncio.get_running_loop()
        self._mlx = MLXThread()
        try:
            if self.config.tensor_parallel_size > 1:
                loaded = await self._start_ranks()
            else:
                loaded = await self._mlx.run(load_model, self.config.model, dtype=weights_dtype(self.config.dtype))
                self._runner = await self._mlx.run(ModelRunner.from_loaded, loaded, self.config, self._failpoints)
        except BaseException:
            if self._group is not None:
                self._group.close(timeout_s=0)
            self._mlx.shutdown()
            self._state = EngineState.STOPPED
            raise
        self._init_text(loaded)
        self._info = EngineInfo(model_path=str(loaded.path), model_type=loaded.config.architecture,
                                dtype=self._runner.dtype_name, kv_block_size=self.config.block_size)
        self._max_model_len = self.config.max_model_len or min(
            loaded.config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        self._init_text(loaded)
        self.metrics.set_max_model_len(self._max_model_len)
        self._core = EngineCore(self._build_scheduler(), self._runner, self._mlx, self.metrics, self._failpoints,
                                self._speculator)
        if self._failpoints:
            logger.warning("failpoints armed: %s", self._failpoints.points)
        self.metrics.set_info(model=self.model_name, dtype=self._runner.dtype_name,
                              kv_blocks=str(self._runner.kv_cache.num_blocks),
                              block_size=str(self.config.block_size),
                              tensor_parallel_size=str(self.config.tensor_parallel_size))
        self._loop_task = asyncio.create_task(self._core.run_forever(), name="metrale-engine-loop")
        self._loop_task.add_done_callback(self._on_loop_done)
        self._state = EngineState.SERVING
        logger.info("engine serving %s: %d KV blocks of %d tokens, max_model_len %d", self.model_name,
                    self._runner.kv_cache.num_blocks, self.config.block_size, self._max_model_len)
        return self

    async def _start_ranks(self) -> LoadedModel:
        """Tensor parallelism: start ranks 1..N-1, join the ring, load this rank's share of the model
        and its runner, and wait for every rank at the startup barrier."""
        from metrale.distributed.group import TensorParallelGroup

        loop = asyncio.get_running_loop()
        dtype = weights_dtype(self.config.dtype)
        self._group = TensorParallelGroup(
            self.config.tensor_parallel_size,
            on_failure=lambda error: loop.call_soon_threadsafe(self._on_rank_failure, error))
        self._group.spawn(self.config.model, dtype)  # from the event-loop thread, which outlives the ranks
        await self._group.wait_joining()
        await self._mlx.run(self._group.join)
        loaded = await self._mlx.run(load_model, self.config.model, dtype=dtype, shard=self._group.shard)
        self._runner = await self._mlx.run(ModelRunner.from_loaded, loaded, self.config, self._failpoints,
                                           self._group)
        kv_dtype = str(self._runner.kv_cache.dtype).removeprefix("mlx.core.")
        await self._mlx.run(self._group.start_steps, self._runner.kv_cache.num_blocks, self.config.block_size, kv_dtype)
        logger.info("tensor parallel: %d ranks, each with its share of the heads and MLP and its own KV pools",
                    self.config.tensor_parallel_size)
        return loaded

    def _on_rank_failure(self, error: BaseException) -> None:
        """A rank died or hung (event-loop thread): the engine is dead, every open request ends with an
        error now, and the loop stops (its step in flight may never return from a dead collective)."""
        if self._core is not None and self._core.dead is None:
            self._core.die(error)
        if self._loop_task is not None:
            self._loop_task.cancel()

    def _init_text(self, loaded: LoadedModel) -> None:
        template = ChatTemplate.for_tokenizer(loaded.tokenizer, loaded.config.architecture)
        self._inputs = InputProcessor(loaded.tokenizer, template, loaded.config.vocab_size,
                                      max_model_len=self._max_model_len, failpoints=self._failpoints)
        self._outputs = OutputProcessor(loaded.tokenizer, self._failpoints)

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
        self._state = EngineState.DRAINING
        deadline = time.monotonic() + timeout_s
        while self._core.num_unfinished and time.monotonic() < deadline and self._core.dead is None:
            await asyncio.sleep(0.02)
        if self._core.num_unfinished:
            logger.warning("drain timeout: aborting %d requests", self._core.num_unfinished)
            self._core.abort_all()

    async def shutdown(self) -> None:
        """Abort what is left, stop the loop and the MLX thread. Leaves nothing running."""
        if self._state is EngineState.STOPPED:
            return
        if self._core is not None:
            self._core.abort_all()  # after the engine died this finds nothing left: die() ended everyone
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._group is not None:  # the followers finish the step they are in and exit
            await asyncio.to_thread(self._group.close)
        if self._mlx is not None:
            # after a rank failed, the step in flight may wait forever in a collective of the dead ring
            group_failed = self._group is not None and self._group.failure is not None
            await asyncio.to_thread(self._mlx.shutdown, not group_failed)
        if self._tokenize_thread is not None:
            self._tokenize_thread.shutdown(wait=False, cancel_futures=True)
        if self._runner is not None:
            self._runner.close()
        self._state = EngineState.STOPPED

    async def __aenter__(self) -> "AsyncEngine":
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # ---- submission ----

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 request_id: str | None = None, priority: int = 0) -> RequestStream | GroupStream:
        """Queue a request and return its stream. Raises a RequestRejectedError (bad input, too long,
        queue full, duplicate id) or an EngineUnavailableError (not running, draining, dead); nothing
        is queued then."""
        with self._counting_rejections():
            inputs = self._accepting()
            params = self._request_params(inputs, params)
            return self._submit(inputs.prompt_ids(prompt), params, request_id, priority)

    async def prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """What `generate` would encode for `prompt`, tokenized on a worker thread when the text is long,
        so that the event loop never stalls on it (the server submits the ids it gets)."""
        with self._counting_rejections():
            inputs = self._accepting()
            if isinstance(prompt, str) and len(prompt) > OFF_LOOP_PROMPT_CHARS:
                inputs.check_length(prompt)
                return await self._off_loop(inputs.prompt_ids, prompt)
            return inputs.prompt_ids(prompt)

    async def chat_token_ids(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """What `chat` would submit for `messages`; a long conversation is tokenized off the event loop."""
        with self._counting_rejections():
            inputs = self._accepting()
            size = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict)) \
                if isinstance(messages, list) else 0
            if size > OFF_LOOP_PROMPT_CHARS:
                return await self._off_loop(inputs.chat_ids, messages, **template_kwargs)
            return inputs.chat_ids(messages, **template_kwargs)

    async def _off_loop(self, fn, *args: Any, **kwargs: Any) -> Any:
        if self._tokenize_thread is None:  # one thread: a flood of huge prompts queues, it does not fan out
            self._tokenize_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrale-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_thread, functools.partial(fn, *args, **kwargs))

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
             request_id: str | None = None, priority: int = 0, tools: Sequence[Any] | None = None) -> RequestStream | GroupStream:
        """Render the model's chat template over messages (and `tools`, given to the template as Hugging
        Face's apply_chat_template passes them), then `generate` from it."""
        with self._counting_rejections():
            inputs = self._accepting()
            params = self._request_params(inputs, params)
            return self._submit(inputs.chat_ids(messages, tools=tools), params, request_id, priority)

    async def prepare(self, params: SamplingParams) -> None:
        """Compile what `params` needs before `generate`/`chat` (a structured-output grammar), on the
        grammar thread; raises InvalidStructuredOutputError naming the problem, or
        StructuredOutputUnavailableError without the `metrale[structured]` extra. Optional: a request
        submitted unprepared waits for its grammar when first scheduled and fails if it does not compile."""
        if params.structured_outputs is None:
            return
        with self._counting_rejections():
            self._accepting()
            compiler = self._grammar_compiler()
            await compiler.compile(params.structured_outputs)

    def _request_params(self, inputs: InputProcessor, params: SamplingParams | None) -> SamplingParams:
        params = inputs.params(_checked_params(params))
        if params.structured_outputs is not None:
            self._grammar_compiler().submit(params.structured_outputs)  # starts compiling now (cached)
        return params

    def _grammar_compiler(self) -> GrammarCompiler:
        compiler = self._runner.grammar_compiler if self._runner is not None else None
        if compiler is None:
            require_llguidance()
            raise StructuredOutputUnavailableError("structured outputs need a tokenizer with an eos token")
        return compiler

    async def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0) -> CompletionResult:
        """Run a request to the end and return its whole result (raises RequestFailedError on error).
        One sequence: iterate `generate` for params.n > 1."""
        if params is not None and params.n != 1:
            raise ValueError(f"complete() returns one sequence; n must be 1, got {params.n} (iterate generate())")
        return await collect_result(self.generate(prompt, params, request_id=request_id, priority=priority))

    def abort(self, request_id: str, *, channel: OutputChannel | None = None) -> bool:
        """Abort a request (sync). Its stream ends with finish_reason "abort" at the next step
        boundary, where its blocks are freed. On the engine's event loop: False when the id is
        unknown or already finished. From another thread the abort is handed to the loop and True
        means only that it was handed over. `channel` (a stream's own) makes the abort apply only to
        the request that stream belongs to, never to a newer one reusing the id."""
        if self._core is None or self._loop is None or self._loop.is_closed():
            return False
        try:
            running_loop = asyncio.get_running_loop()
        except RuntimeError:
            running_loop = None
        if running_loop is not self._loop:  # e.g. a stream collected on another thread
            self._loop.call_soon_threadsafe(functools.partial(self._core.abort, request_id, channel))
            return True
        return self._core.abort(request_id, channel)

    def abort_all(self) -> None:
        """Abort every unfinished request now (a forced shutdown); each stream ends with "abort"."""
        if self._core is not None:
            self._core.abort_all()

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
        if self._state is EngineState.DRAINING:
            raise EngineDrainingError("engine is draining for shutdown; not accepting requests")
        if self._state is not EngineState.SERVING or self._inputs is None or self._core is None:
            raise EngineNotRunningError(f"engine is {self._state}; call start() first")
        if self._core.dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self._core.dead!r}")
        return self._inputs

    def _submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None,
                priority: int) -> RequestStream | GroupStream:
        """One sequence (a RequestStream), or params.n sequences sharing the prompt (a GroupStream whose
        deltas carry their sequence's index; sequence i is request `request_id#i`, 0 is `request_id`)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        max_tokens = self._max_tokens(params, len(prompt_ids))
        eos = self._inputs.tokenizer.eos_token_ids
        if params.n == 1:
            text = self._outputs.new_request(prompt_ids, params, request_id)
            channel = self._core.submit(request_id, prompt_ids, params, text, priority=priority,
                                        eos_token_ids=eos, max_tokens=max_tokens)
            return RequestStream(channel, functools.partial(self.abort, channel=channel))
        ids = [request_id, *(f"{request_id}#{i}" for i in range(1, params.n))]
        sequences = [params.for_sequence(i) for i in range(params.n)]
        texts = [self._outputs.new_request(prompt_ids, p, rid) for rid, p in zip(ids, sequences)]
        channels = self._core.submit_group(ids, prompt_ids, sequences, texts, priority=priority,
                                           eos_token_ids=eos, max_tokens=max_tokens)
        return GroupStream(channels, lambda channel: self.abort(channel.request_id, channel=channel))

    def _max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """params.max_tokens, or when it is None the room left in the context and in the KV pool."""
        if params.max_tokens is not None:
            return params.max_tokens
        pool_tokens = self._runner.kv_cache.num_slots
        room = min(self._max_model_len - num_prompt_tokens, pool_tokens + 1 - num_prompt_tokens)
        if room < 1:
            raise PromptTooLongError(f"prompt ({num_prompt_tokens} tokens) leaves no room for output in "
                                     f"max_model_len ({self._max_model_len})")
        return max(room, params.min_tokens)

    # ---- introspection (metrale.engine.protocol.EngineClient) ----

    @property
    def model_name(self) -> str:
        return self._runner.model_name if self._runner is not None else _model_label(self.config.model)

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens a request may hold; 0 until the engine has started."""
        return self._max_model_len

    @property
    def tool_call_format(self) -> str | None:
        """How the model writes tool calls (from its chat template), or None; known once started."""
        return detect_format(self._inputs.chat_template.source) if self._inputs is not None else None

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

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of a token sequence (special tokens kept), e.g. a prompt given as ids, echoed back."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([token_id]) for token_id in token_ids]

    def failpoints_fired(self) -> dict[str, int]:
        """How many times each armed failpoint raised (empty when none is armed)."""
        return dict(self._failpoints.fired)

    def record_rejected(self, reason: str) -> None:
        self.metrics.record_rejected(reason)

    def metrics_exposition(self) -> bytes:
        return generate_latest(self.registry)

    def health(self) -> EngineState:
        """"loading" | "serving" | "draining" | "unhealthy" | "stopped". Unhealthy: the engine died, or
        a step has run far past its expected time (the watchdog; it recovers if the step ends)."""
        if self._state is EngineState.STOPPED:
            return EngineState.STOPPED
        if self._core is not None and (self._core.dead is not None or self._step_stuck()):
            return EngineState.UNHEALTHY
        return self._state

    def _step_stuck(self) -> bool:
        started = self._core.step_started
        if started is None:
            return False
        return time.monotonic() - started > max(WATCHDOG_MIN_S, WATCHDOG_FACTOR * self._core.mean_step_s)

    async def wait_until_dead(self) -> BaseException | None:
        """Wait for the engine loop to end: the error that killed it, or None when it was shut down."""
        while self._loop_task is None:
            await asyncio.sleep(0.1)
        await asyncio.gather(self._loop_task, return_exceptions=True)
        return self._core.dead if self._core is not None else None

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


async def collect_result(stream: RequestStream) -> CompletionResult:
    """Read a stream to its end into one CompletionResult; leaving early (an error, a cancel) aborts
    the request."""
    async with stream:
        outputs = [out async for out in stream]
    return CompletionResult.from_outputs(stream.request_id, outputs)


def _checked_params(params: SamplingParams | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    return params
