"""Starting an engine: the model and its runner on the MLX thread, under the runtime settings.

    settings = RuntimeSettings.resolve(config)        once, when the AsyncEngine is made
    started = await load(config, settings, ...)       load_model + runner (+ tensor-parallel ranks)
    text = TextFrontEnd.for_model(started.loaded, ...) the tokenizer side, built once

Everything built on the MLX thread is built inside `kernels.settings.applied(settings.kernels)`, so the
model's layers, its KV pools and the kernels decide from the engine's settings, not from the environment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kernels.settings import applied
from kvcache.manager import KVCacheManager
from metrale.config import EngineConfig
from metrale.engine.mlx_thread import MLXThread
from metrale.engine.runner import ModelRunner, weights_dtype
from metrale.errors import TensorParallelError
from metrale.failpoints import Failpoints
from metrale.loading import LoadedModel, load_model
from metrale.loading.generation_defaults import read_sampling_defaults
from metrale.settings import RuntimeSettings
from metrale.text.chat_template import ChatTemplate
from metrale.text.processor import InputProcessor, OutputProcessor
from metrale.text.tokenizer import Tokenizer
from scheduler import Scheduler

if TYPE_CHECKING:  # imported when tensor parallelism starts: a one-rank engine never loads metrale.distributed
    from metrale.distributed.group import TensorParallelGroup

logger = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192  # cap of the model's own context length when max_model_len is None
T = TypeVar("T")


class RunnerFactory(Protocol):
    """Builds the runner of a loaded model, on the MLX thread: `ModelRunner.from_loaded` (the default) or a
    subclass's (tests observe, hold or fail steps with one; see tests/metrale/engine/fakes.py)."""

    def __call__(self, loaded: LoadedModel, config: EngineConfig, failpoints: Failpoints,
                 group: TensorParallelGroup | None = None, *, settings: Any = None) -> ModelRunner: ...


class RunnerKeeper:
    """A RunnerFactory that keeps the runner it built (`runner`), for benchmarks and tools that time or read the
    runner of an engine they start (`AsyncEngine(config, runner_factory=keeper)`), without reaching into it."""

    def __init__(self, factory: RunnerFactory | None = None) -> None:
        self._factory = factory if factory is not None else ModelRunner.from_loaded
        self.runner: ModelRunner | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> ModelRunner:
        self.runner = self._factory(*args, **kwargs)
        return self.runner


def default_model_label(model: str | None) -> str:
    """The model_name metric label, known before loading: the file or folder name."""
    if model is None:
        return "SmolLM2-135M-Instruct.Q4_1"
    return Path(model).stem if model.endswith(".gguf") else Path(model).name or model


@dataclass(frozen=True, slots=True)
class Loaded:
    """What `load` built: the model (its tokenizer feeds the text front-end), its runner and, under tensor
    parallelism, rank 0's handle on the other ranks."""

    model: LoadedModel
    runner: ModelRunner
    group: TensorParallelGroup | None

    def max_model_len(self, config: EngineConfig) -> int:
        """config.max_model_len, else the model's context length capped at DEFAULT_MAX_MODEL_LEN."""
        return config.max_model_len or min(self.model.config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)

    def scheduler(self, config: EngineConfig) -> Scheduler:
        """A scheduler over the runner's KV pool, with the resolved max_model_len."""
        scheduler_config = dataclasses.replace(config.scheduler, max_model_len=self.max_model_len(config))
        kv = KVCacheManager(num_blocks=self.runner.kv_cache.num_blocks, block_size=scheduler_config.block_size,
                            enable_prefix_caching=scheduler_config.enable_prefix_caching)
        return Scheduler(scheduler_config, kv)


async def load(config: EngineConfig, settings: RuntimeSettings, failpoints: Failpoints, mlx: MLXThread,
               runner_factory: RunnerFactory, on_rank_failure: Callable[[TensorParallelError], None]) -> Loaded:
    """Load the model and build its runner (starting the ranks first under tensor parallelism). On a failure
    the ranks already started are stopped; the caller shuts the MLX thread down."""
    if config.tensor_parallel_size == 1:
        loaded = await _on_mlx(mlx, settings, load_model, config.model, dtype=weights_dtype(config.dtype))
        runner = await _on_mlx(mlx, settings, runner_factory, loaded, config, failpoints, settings=settings.kernels)
        return Loaded(loaded, runner, None)
    from metrale.distributed.group import TensorParallelGroup

    loop = asyncio.get_running_loop()
    group = TensorParallelGroup(config.tensor_parallel_size, step_timeout=settings.tp_step_timeout_s,
                                on_failure=lambda error: loop.call_soon_threadsafe(on_rank_failure, error))
    try:
        return await _start_ranks(config, settings, failpoints, mlx, runner_factory, group)
    except BaseException:
        group.close(timeout_s=0)
        raise


async def _start_ranks(config: EngineConfig, settings: RuntimeSettings, failpoints: Failpoints, mlx: MLXThread,
                       runner_factory: RunnerFactory, group: TensorParallelGroup) -> Loaded:
    """Start ranks 1..N-1, join the ring, load this rank's share of the model and its runner, and wait for
    every rank at the startup barrier."""
    dtype = weights_dtype(config.dtype)
    group.spawn(config.model, dtype)  # from the event-loop thread, which outlives the ranks
    await group.wait_joining()
    await mlx.run(group.join)
    loaded = await _on_mlx(mlx, settings, load_model, config.model, dtype=dtype, shard=group.shard)
    runner = await _on_mlx(mlx, settings, runner_factory, loaded, config, failpoints, group,
                           settings=settings.kernels)
    kv_dtype = str(runner.kv_cache.dtype).removeprefix("mlx.core.")
    await mlx.run(group.start_steps, runner.kv_cache.num_blocks, config.block_size, kv_dtype)
    logger.info("tensor parallel: %d ranks, each with its share of the heads and MLP and its own KV pools",
                config.tensor_parallel_size)
    return Loaded(loaded, runner, group)


async def _on_mlx(mlx: MLXThread, runtime: RuntimeSettings, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn on the MLX thread, building under the engine's kernel settings."""
    def build() -> T:
        with applied(runtime.kernels):
            return fn(*args, **kwargs)

    return await mlx.run(build)


def read_model_sampling_defaults(config: EngineConfig, path: Path) -> dict[str, Any]:
    """The model's own sampling defaults, for what a request leaves unset ({} with generation_config "vllm",
    or when they cannot be read: the model loaded, its defaults never stop a start)."""
    if config.generation_config == "vllm":
        return {}
    try:
        defaults = read_sampling_defaults(path)
    except (ValueError, OSError, struct.error) as error:
        logger.warning("the model's sampling defaults could not be read from %s: %s", path, error)
        return {}
    if defaults:
        logger.info("the model's sampling defaults (for requests that leave them unset): %s", defaults)
    return defaults


@dataclass(frozen=True, slots=True)
class TextFrontEnd:
    """The tokenizer side of a started engine: prompts in, text out."""

    inputs: InputProcessor
    outputs: OutputProcessor

    @classmethod
    def for_model(cls, loaded: LoadedModel, max_model_len: int, failpoints: Failpoints) -> "TextFrontEnd":
        return cls.for_tokenizer(loaded.tokenizer, loaded.config.architecture, loaded.config.vocab_size,
                                 max_model_len, failpoints)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, architecture: str, vocab_size: int, max_model_len: int,
                      failpoints: Failpoints) -> "TextFrontEnd":
        """The front-end of a model loaded elsewhere (an engine process sends its tokenizer and facts)."""
        template = ChatTemplate.for_tokenizer(tokenizer, architecture)
        return cls(InputProcessor(tokenizer, template, vocab_size, max_model_len=max_model_len, failpoints=failpoints),
                   OutputProcessor(tokenizer, failpoints))
