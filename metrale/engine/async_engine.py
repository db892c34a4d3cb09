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
import functools
import logging
import time
from pathlib import Path
from typing import Any, Sequence

from prometheus_client import CollectorRegistry, generate_latest

from metrale.config import EngineConfig
from metrale.engine.core import EngineCore
from metrale.engine.core_host import LocalCore
from metrale.engine.engine_client import EngineProcess
from metrale.engine.hang_watch import WATCHDOG_FACTOR, WATCHDOG_MIN_S
from metrale.engine.ipc import ModelFacts, TokenizerSpec
from metrale.engine.lora_registry import LoraAdapters
from metrale.engine.metrics import EngineMetrics
from metrale.engine.runner import ModelRunner
from metrale.engine.startup import RunnerFactory, TextFrontEnd, default_model_label, read_model_sampling_defaults
from metrale.engine.stream import GroupStream, OutputChannel, RequestStream
from metrale.engine.streams import RequestStreams
from metrale.engine.submission import (Submission, collect_embeddings, collect_result, counting_rejections,
                                       prepares_text)
from metrale.errors import EngineDeadError, EngineDrainingError, EngineNotRunningError, EngineRestartingError
from metrale.failpoints import Failpoints
from metrale.outputs import CompletionResult, EmbeddingOutput, EngineInfo, EngineState, EngineStats
from metrale.pooling_params import PoolingParams
from metrale.sampling_params import SamplingParams
from metrale.settings import RuntimeSettings
from metrale.speculative.proposers import HostProposer
from metrale.speculative.speculator import Speculator
from metrale.text.tokenizer import Tokenizer
from metrale.text.output_parsing import detect_format
from metrale.text.reasoning import detect_reasoning
from scheduler import LoraRef

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Continuous-batching engine: many concurrent requests, one batched forward per step."""

    def __init__(self, config: EngineConfig | None = None, *, registry: CollectorRegistry | None = None,
                 proposer: HostProposer | None = None, settings: RuntimeSettings | None = None,
                 runner_factory: RunnerFactory | None = None) -> None:
        """`proposer`: a host-side draft proposer to speculate with instead of the configured method's
        (metrale.speculative.proposers; needs a speculative_config for num_speculative_tokens and the policy).
        `settings`: the runtime settings (default: RuntimeSettings.resolve(config), from the environment).
        `runner_factory`: builds the runner of the loaded model on the MLX thread (default
        ModelRunner.from_loaded; tests pass a subclass's to observe, hold or fail steps)."""
        self.config = config or EngineConfig()
        self.settings = settings if settings is not None else RuntimeSettings.resolve(self.config)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = EngineMetrics(self.registry, model_name=default_model_label(self.config.model))
        self._runner_factory = runner_factory if runner_factory is not None else ModelRunner.from_loaded
        self._state = EngineState.STOPPED  # stopped -> loading -> serving -> draining -> stopped
        self._client: LocalCore | EngineProcess | None = None  # the engine core, here or in its process
        self._core: EngineCore | None = None  # in-process only (tests reach for it)
        self._streams: RequestStreams | None = None  # the text front-end of every open request
        self._facts: ModelFacts | None = None  # set at start
        self._submission: Submission | None = None
        self._loras: LoraAdapters | None = None  # set at start
        self._sampling_defaults: dict[str, Any] = {}
        self._max_model_len = 0  # resolved at start
        self._info: EngineInfo | None = None  # set at start
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failpoints = Failpoints.from_spec(self.settings.failpoints, seed=self.config.seed)
        spec = self.config.speculative_config
        if proposer is not None and spec is None:
            raise ValueError("a proposer needs EngineConfig(speculative_config=...): how many drafts, and when")
        if self.config.engine_process and (proposer is not None or runner_factory is not None):
            raise ValueError("a proposer or runner_factory object cannot cross to an engine process: "
                             "use engine_process=False")
        self._speculator = Speculator(spec, proposer) if spec is not None else None
        if spec is not None:
            self.metrics.enable_speculation(spec.num_speculative_tokens)

    # ---- lifecycle ----

    async def start(self) -> "AsyncEngine":
        """Load the model (on the MLX thread, or in the engine process) and start the engine loop."""
        if self._state is not EngineState.STOPPED:
            raise RuntimeError(f"engine already {self._state}")
        self._state = EngineState.LOADING
        self._loop = asyncio.get_running_loop()
        try:
            if self.config.engine_process:
                client = EngineProcess(self.config, self.metrics, self.config.max_engine_restarts,
                                       self.settings.engine_hang_timeout_s)
                ready = await client.start()
                tokenizer, facts, self._max_model_len = _tokenizer(ready.tokenizer), ready.facts, ready.max_model_len
                client.on_death = self._on_engine_death
            else:
                client = LocalCore(self.config, self.settings, self.metrics, self._failpoints, self._speculator,
                                   self._runner_factory)
                loaded = await client.start()
                tokenizer, facts, self._max_model_len = loaded.tokenizer, client.facts(loaded), client.max_model_len
                self._core = client.core
        except BaseException:
            self._state = EngineState.STOPPED
            raise
        self._client, self._facts = client, facts
        # only the model file's header is read (generation_config.json, a GGUF's general.sampling.*)
        self._sampling_defaults = await asyncio.to_thread(read_model_sampling_defaults, self.config,
                                                          Path(facts.model_path))
        self._info = EngineInfo(model_path=facts.model_path, model_type=facts.architecture, dtype=facts.dtype_name,
                                kv_block_size=self.config.block_size)
        self.metrics.set_max_model_len(self._max_model_len)
        self._streams = RequestStreams(client.finish, self._failpoints)
        client.set_on_outputs(self._streams.process)
        text = TextFrontEnd.for_tokenizer(tokenizer, facts.architecture, facts.vocab_size, self._max_model_len,
                                          self._failpoints)
        self._submission = Submission(text, client, facts, self._streams, self._max_model_len, self.abort)
        self._loras = LoraAdapters(facts, self.config.max_lora_rank, self.config.max_lora_adapters)
        if self._failpoints:
            logger.warning("failpoints armed: %s", self._failpoints.points)
        self.metrics.set_info(model=self.model_name, dtype=facts.dtype_name, kv_blocks=str(facts.kv_blocks),
                              block_size=str(self.config.block_size),
                              tensor_parallel_size=str(self.config.tensor_parallel_size))
        self._state = EngineState.SERVING
        logger.info("engine serving %s%s: %d KV blocks of %d tokens, max_model_len %d", self.model_name,
                    " (engine process)" if self.config.engine_process else "", facts.kv_blocks,
                    self.config.block_size, self._max_model_len)
        return self

    def _on_engine_death(self, error: BaseException) -> None:
        """The engine process died: every open stream ends with the error now (it restarts, or not)."""
        self._streams.fail_all(error)

    @property
    def num_unfinished(self) -> int:
        """Requests whose streams have not ended yet."""
        return len(self._streams) if self._streams is not None else 0

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting requests, let in-flight ones finish for up to timeout_s, abort the rest."""
        if self._client is None:
            return
        self._state = EngineState.DRAINING
        deadline = time.monotonic() + timeout_s
        while self.num_unfinished and time.monotonic() < deadline and self._client.dead is None:
            await asyncio.sleep(0.02)
        if self.num_unfinished:
            logger.warning("drain timeout: aborting %d requests", self.num_unfinished)
            self._client.abort_all()

    async def shutdown(self) -> None:
        """Abort what is left, stop the engine (its loop and MLX thread, or its process). Leaves nothing running."""
        if self._state is EngineState.STOPPED:
            return
        if self._client is not None:
            self._client.abort_all()  # after the engine died this finds nothing left: every stream has ended
            await self._client.shutdown()
        if self._streams is not None:  # an engine process that died at shutdown: what it did not end
            self._streams.fail_all(EngineNotRunningError("engine shut down"))
        if self._submission is not None:
            self._submission.close()
        self._state = EngineState.STOPPED

    async def __aenter__(self) -> "AsyncEngine":
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # ---- submission (metrale.engine.submission) ----

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 request_id: str | None = None, priority: int = 0, lora: str | None = None) -> RequestStream | GroupStream:
        """Queue a request and return its stream. Raises a RequestRejectedError (bad input, too long,
        queue full, duplicate id, an unknown `lora`) or an EngineUnavailableError (not running, draining,
        dead); nothing is queued then. `lora`: a registered adapter's name (`add_lora`)."""
        with counting_rejections(self.metrics):
            submission = self._accepting()
            return submission.generate(prompt, params, request_id, priority, self._lora_ref(lora))

    async def prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """What `generate` would encode for `prompt`, tokenized on a worker thread when the text is long,
        so that the event loop never stalls on it (the server submits the ids it gets)."""
        with counting_rejections(self.metrics):
            return await self._accepting().prompt_token_ids(prompt)

    async def chat_token_ids(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """What `chat` would submit for `messages`; a long conversation is tokenized off the event loop."""
        with counting_rejections(self.metrics):
            return await self._accepting().chat_token_ids(messages, **template_kwargs)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
             request_id: str | None = None, priority: int = 0, tools: Sequence[Any] | None = None,
             lora: str | None = None) -> RequestStream | GroupStream:
        """Render the model's chat template over messages (and `tools`, given to the template as Hugging
        Face's apply_chat_template passes them), then `generate` from it (with the adapter `lora`)."""
        with counting_rejections(self.metrics):
            submission = self._accepting()
            return submission.chat(messages, params, request_id, priority, tools, self._lora_ref(lora))

    async def prepare(self, params: SamplingParams) -> None:
        """Compile what `params` needs before `generate`/`chat` (a structured-output grammar), on the
        grammar thread; raises InvalidStructuredOutputError naming the problem, or
        StructuredOutputUnavailableError without the `metrale[structured]` extra. Optional: a request
        submitted unprepared waits for its grammar when first scheduled and fails if it does not compile.
        Many bad words are tokenized and many stop strings compiled here too, on the tokenize thread (cached
        for `generate`)."""
        if params.structured_outputs is None and not prepares_text(params):
            return
        with counting_rejections(self.metrics):
            await self._accepting().prepare(params)

    async def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0, lora: str | None = None) -> CompletionResult:
        """Run a request to the end and return its whole result (raises RequestFailedError on error).
        One sequence: iterate `generate` for params.n > 1."""
        if params is not None and params.n != 1:
            raise ValueError(f"complete() returns one sequence; n must be 1, got {params.n} (iterate generate())")
        return await collect_result(self.generate(prompt, params, request_id=request_id, priority=priority, lora=lora))

    # ---- LoRA adapters (metrale.engine.lora_registry) ----

    async def add_lora(self, name: str, path: str) -> None:
        """Register the LoRA adapter folder `path` (mlx-lm or PEFT) as `name`, checked against the model;
        InvalidLoraAdapterError names what is wrong. Its weights load when a request first uses it."""
        await self._started_loras().add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Unregister an adapter (requests running with it finish with it); False if unknown."""
        return self._started_loras().remove(name)

    def list_loras(self) -> dict[str, str]:
        """Registered adapter name -> its folder."""
        return self._started_loras().names()

    def _started_loras(self) -> LoraAdapters:
        if self._loras is None:
            raise EngineNotRunningError("engine not started")
        return self._loras

    def _lora_ref(self, name: str | None) -> LoraRef | None:
        return None if name is None else self._started_loras().get(name)

    async def embed(self, prompts: Sequence[str | Sequence[int]], params: PoolingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0) -> list[EmbeddingOutput]:
        """One embedding per prompt (text or token ids), in order: each prompt is computed through the scheduler
        like any other (batched with the other requests' work, chunked when long), pooled from the final hidden
        states as EngineConfig.pooling says, then its KV blocks are freed. Raises a RequestRejectedError (too
        many prompts, an empty or too long one, bad ids, `dimensions` the model does not support, queue full)
        and queues nothing then; RequestFailedError if one fails. Cancelling the call aborts every prompt."""
        with counting_rejections(self.metrics):
            streams = await self._accepting().embed(prompts, params, request_id, priority)
        return await collect_embeddings(streams)

    def abort(self, request_id: str, *, channel: OutputChannel | None = None) -> bool:
        """Abort a request (sync). Its stream ends with finish_reason "abort" at the next step
        boundary, where its blocks are freed. On the engine's event loop: False when the id is
        unknown or already finished. From another thread the abort is handed to the loop and True
        means only that it was handed over. `channel` (a stream's own) makes the abort apply only to
        the request that stream belongs to, never to a newer one reusing the id."""
        if self._client is None or self._loop is None or self._loop.is_closed():
            return False
        try:
            running_loop = asyncio.get_running_loop()
        except RuntimeError:
            running_loop = None
        if running_loop is not self._loop:  # e.g. a stream collected on another thread
            self._loop.call_soon_threadsafe(functools.partial(self._abort, request_id, channel))
            return True
        return self._abort(request_id, channel)

    def _abort(self, request_id: str, channel: OutputChannel | None) -> bool:
        if channel is not None and self._streams.channel(request_id) is not channel:
            return False  # that stream's request ended; the id may be a newer request's now
        return self._client.abort(request_id)

    def abort_all(self) -> None:
        """Abort every unfinished request now (a forced shutdown); each stream ends with "abort"."""
        if self._client is not None:
            self._client.abort_all()

    def _accepting(self) -> Submission:
        if self._state is EngineState.DRAINING:
            raise EngineDrainingError("engine is draining for shutdown; not accepting requests")
        if self._state is not EngineState.SERVING or self._submission is None or self._client is None:
            raise EngineNotRunningError(f"engine is {self._state}; call start() first")
        if self._client.dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self._client.dead!r}")
        if self._client.restarting:
            raise EngineRestartingError("the engine process is restarting; retry shortly")
        return self._submission

    # ---- introspection (metrale.engine.protocol.EngineClient) ----

    @property
    def model_name(self) -> str:
        return self._facts.model_name if self._facts is not None else default_model_label(self.config.model)

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens a request may hold; 0 until the engine has started."""
        return self._max_model_len

    @property
    def tool_call_format(self) -> str | None:
        """How the model writes tool calls (from its chat template), or None; known once started."""
        return detect_format(self._submission.inputs.chat_template.source) if self._submission else None

    @property
    def reasoning_format(self) -> str | None:
        """How the model marks its reasoning (from its chat template), or None; known once started."""
        return detect_reasoning(self._submission.inputs.chat_template.source) if self._submission else None

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's sampling defaults for what a request leaves unset ({} with generation_config "vllm")."""
        return dict(self._sampling_defaults)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (for counting tokens, building prompts)."""
        return self._started().inputs.tokenizer

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (the width of its logits)."""
        return self._started().inputs.vocab_size

    def _started(self) -> Submission:
        if self._submission is None:
            raise EngineNotRunningError("engine not started")
        return self._submission

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of a token sequence (special tokens kept), e.g. a prompt given as ids, echoed back."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([token_id]) for token_id in token_ids]

    def failpoints_fired(self) -> dict[str, int]:
        """How many times each armed failpoint raised (empty when none is armed)."""
        return dict(self._failpoints.fired)

    def disarm_failpoints(self) -> None:
        """Stop injecting faults (chaos tooling: end the faults, then check that the engine recovered)."""
        self._failpoints.disarm()

    def record_rejected(self, reason: str) -> None:
        self.metrics.record_rejected(reason)

    def metrics_exposition(self) -> bytes:
        return generate_latest(self.registry)

    def health(self) -> EngineState:
        """"loading" | "serving" | "draining" | "unhealthy" | "stopped". Unhealthy: the engine died, or
        a step has run far past its expected time (the watchdog; it recovers if the step ends)."""
        if self._state is EngineState.STOPPED:
            return EngineState.STOPPED
        if self._client is not None and (self._client.dead is not None or self._step_stuck()):
            return EngineState.UNHEALTHY
        if self._client is not None and self._client.restarting:
            return EngineState.RESTARTING
        return self._state

    def _step_stuck(self) -> bool:
        """The step watchdog (in-process engine only)."""
        if self._core is None:
            return False
        started = self._core.step_started
        if started is None:
            return False
        return time.monotonic() - started > max(WATCHDOG_MIN_S, WATCHDOG_FACTOR * self._core.mean_step_s)

    async def wait_until_dead(self) -> BaseException | None:
        """Wait for the engine to end: the error that killed it for good, or None when it was shut down."""
        while self._client is None:
            await asyncio.sleep(0.1)
        return await self._client.wait_until_dead()

    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineNotRunningError("engine not started")
        return self._info

    def stats(self) -> EngineStats:
        if self._client is None:
            raise EngineNotRunningError("engine not started")
        core = self._client.core_stats()
        return EngineStats(
            health=self.health(), running=core.running, waiting=core.waiting, kv_blocks_total=core.kv_blocks_total,
            kv_blocks_free=core.kv_blocks_free, kv_usage=core.kv_usage, peak_kv_usage=core.peak_kv_usage,
            num_preemptions=core.num_preemptions, num_steps=core.num_steps,
            prefix_cache_queries=core.prefix_cache_queries, prefix_cache_hits=core.prefix_cache_hits,
            requests_finished=core.requests_finished, requests_unfinished=self.num_unfinished)

    def check_integrity(self) -> None:
        """Raise if the KV accounting is inconsistent (tests call this after every scenario)."""
        if self._client is None:
            raise EngineNotRunningError("engine not started")
        self._client.check_integrity()


def _tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """The engine process's tokenizer, rebuilt here from what it sent."""
    from tokenizers import Tokenizer as HFTokenizer

    return Tokenizer(HFTokenizer.from_str(spec.backend_json), bos_token_id=spec.bos_token_id,
                     eos_token_ids=spec.eos_token_ids, chat_template=spec.chat_template, pad_token_id=spec.pad_token_id)
