"""mlx-lm's `BatchGenerator` as a load-generator target, on the weights metrale loaded.

    keeper = RunnerKeeper(); engine = AsyncEngine(config, runner_factory=keeper)   # started: keeper.runner
    model_factory = partial(mlx_lm_model, keeper.runner.model_config, keeper.runner.model)
    async with MlxLmTarget(model_factory) as target:           # a thread of its own
        async for chunk in target.stream(BenchRequest(...)): ...

The driver does what mlx-lm's own server does (`mlx_lm/server.py`, `ResponseGenerator._generate`):
one generation thread inserts requests as they arrive, calls `next()` in a loop, hands every token
to its request and `remove()`s cancelled ones, with the server's defaults (decode concurrency 32,
prompt concurrency 8, prefill step 2048) and its greedy sampler (temperature 0). It does less than
the server per token (no detokenizing, no logprob `.item()`, no prompt-cache bookkeeping), so it
is, if anything, faster than serving mlx-lm over HTTP. mlx-lm is a benchmark-only dependency.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from metrale.bench.targets import Chunk, TargetError
from metrale.bench.workloads import BenchRequest

logger = logging.getLogger(__name__)
_STOP = object()


def mlx_lm_model(config: Any, metrale_model: Any) -> Any:
    """An `mlx_lm.models.llama.Model` built from a metrale ModelConfig, holding the same weight
    arrays as the metrale model (no copy; same dtype). Llama-family configs without RoPE scaling or
    sliding windows only (ValueError otherwise)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    if config.architecture not in ("llama", "mistral") or config.rope_scaling or config.sliding_window \
            or config.layer_types or config.rope_freq_factors:
        raise ValueError(f"the mlx-lm comparison supports plain llama configs, got {config}")
    args = llama.ModelArgs(
        model_type="llama", hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        intermediate_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
        rms_norm_eps=config.rms_norm_eps, vocab_size=config.vocab_size, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, num_key_value_heads=config.num_key_value_heads,
        attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, rope_theta=config.rope_theta,
        rope_traditional=config.rope_traditional, tie_word_embeddings=config.tie_word_embeddings)
    model = llama.Model(args)
    model.load_weights(tree_flatten(metrale_model.parameters()), strict=True)
    return model


@dataclass(eq=False)
class _Handle:
    """One request as the generation thread sees it."""

    prompt: list[int]
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue
    uid: int | None = None
    cancelled: bool = False
    finished: bool = False


class MlxLmTarget:
    """A load-generator target running mlx-lm's BatchGenerator on its own thread."""

    name = "mlx-lm"

    def __init__(self, model_factory: Callable[[], Any], *, completion_batch_size: int = 32,
                 prefill_batch_size: int = 8, prefill_step_size: int = 2048) -> None:
        self.model_factory = model_factory
        self.generator_args = {"completion_batch_size": completion_batch_size,
                               "prefill_batch_size": prefill_batch_size, "prefill_step_size": prefill_step_size}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None

    async def __aenter__(self) -> "MlxLmTarget":
        self._thread = threading.Thread(target=self._run, name="mlx-lm-generation", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._ready.wait)
        if self.error is not None:
            raise TargetError(f"mlx-lm failed to start: {self.error!r}") from self.error
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._inbox.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    async def stream(self, request: BenchRequest) -> AsyncIterator[Chunk]:
        if not isinstance(request.prompt, list):
            raise TargetError("the mlx-lm target takes token-id prompts (tokenize chat/text first)")
        if self.error is not None:
            raise TargetError(f"mlx-lm generation thread died: {self.error!r}")
        handle = _Handle(request.prompt, request.output_len, asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(handle)
        try:
            while True:
                token, finish, error = await handle.sink.get()
                if error is not None:
                    raise TargetError(f"mlx-lm step failed: {error!r}") from error
                if token is not None:
                    yield Chunk(1, prompt_tokens=len(handle.prompt), token_ids=(token,))
                if finish:
                    return
        finally:
            if not handle.finished:
                handle.cancelled = True
                self._inbox.put(("cancel", handle))

    # ---- the generation thread ----

    def _run(self) -> None:
        from kernels.runtime import release_thread_state

        try:
            self._generate()
        finally:
            release_thread_state()  # this thread's MLX state, before it ends (else exit can abort)

    def _generate(self) -> None:
        from kernels.runtime import mx
        from mlx_lm.generate import BatchGenerator

        try:
            model = self.model_factory()
            generator = BatchGenerator(model, stream=mx.default_stream(mx.default_device()), **self.generator_args)
        except Exception as error:  # reported to __aenter__, which raises it
            self.error = error
            self._ready.set()
            return
        self._ready.set()
        active: dict[int, _Handle] = {}
        try:
            while self._admit(generator, active):
                self._step(generator, active)
        except Exception as error:  # a failed step fails every request in flight, as metrale does
            logger.exception("mlx-lm generation thread failed")
            self.error = error
            for handle in active.values():
                handle.loop.call_soon_threadsafe(handle.sink.put_nowait, (None, True, error))
        finally:
            generator.close()

    def _admit(self, generator: Any, active: dict[int, _Handle]) -> bool:
        """Take what arrived (blocking while idle): insert new requests, remove cancelled ones.
        False on stop."""
        items = [] if active else [self._inbox.get()]
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        new = [h for h in items if isinstance(h, _Handle) and not h.cancelled]
        if new:
            uids = generator.insert([h.prompt for h in new], max_tokens=[h.max_tokens for h in new])
            for uid, handle in zip(uids, new):
                handle.uid = uid
                active[uid] = handle
        gone = [item[1].uid for item in items if isinstance(item, tuple) and item[1].uid in active]
        if gone:
            generator.remove(gone)
            for uid in gone:
                del active[uid]
        return not any(item is _STOP for item in items)

    def _step(self, generator: Any, active: dict[int, _Handle]) -> None:
        """One `next()`: every generated token goes to its request, in one hop per event loop."""
        if not active:
            return
        _, responses = generator.next()
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[_Handle, int, bool]]] = {}
        for r in responses:
            handle = active.get(r.uid)
            if handle is None:
                continue  # removed (cancelled) while this step ran
            finish = r.finish_reason is not None
            if finish:
                handle.finished = True
                del active[r.uid]
            deliveries.setdefault(handle.loop, []).append((handle, r.token, finish))
        for loop, items in deliveries.items():
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[_Handle, int, bool]]) -> None:
    for handle, token, finish in items:
        handle.sink.put_nowait((token, finish, None))
