"""LLM: the blocking API, for scripts and batch jobs.

    with LLM(EngineConfig()) as llm:
        results = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=16))
        with llm.stream("Once upon a time", SamplingParams(max_tokens=32)) as deltas:
            for out in deltas:
                print(out.text, end="", flush=True)

One background thread runs an event loop that owns one AsyncEngine. Every call hands a coroutine to
that loop (`asyncio.run_coroutine_threadsafe`) and waits for it in the caller's thread; errors cross
as values and are raised there with their own types (RequestRejectedError, RequestFailedError, ...).
Any number of threads may call at once: their requests batch together in the one engine.

    caller threads --coroutine--> "metrale-llm" thread: event loop, AsyncEngine, EngineCore
                   <--result / error--           |  await
                                        "metrale-mlx" thread: the forward passes

An LLM still open when the interpreter exits is closed first (its threads joined): left running, its daemon
threads were still inside MLX when C++'s static destructors ran, and 4 of 6 such exits aborted ("terminate
called without an active exception", exit status 134). The hook is threading's own exit hook
(`threading._register_atexit`, as concurrent.futures uses), which runs before the default executors shut
down: the engine's shutdown still needs one (an `atexit` hook runs after, and the shutdown failed there).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from metrale.config import EngineConfig
from metrale.engine.async_engine import AsyncEngine, collect_result
from metrale.engine.startup import RunnerFactory
from metrale.engine.stream import RequestStream
from metrale.errors import EngineNotRunningError, RequestFailedError
from metrale.outputs import CompletionResult, EmbeddingOutput, EngineStats, RequestOutput
from metrale.pooling_params import PoolingParams
from metrale.sampling_params import SamplingParams
from metrale.settings import RuntimeSettings
from metrale.text.tokenizer import Tokenizer

T = TypeVar("T")
Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, Any]]


class LLM:
    """A blocking front to one AsyncEngine, started at construction; `close()` (or leaving `with`)
    aborts what is still running and stops every thread it started."""

    def __init__(self, config: EngineConfig | None = None, *, registry: CollectorRegistry | None = None,
                 settings: RuntimeSettings | None = None, runner_factory: RunnerFactory | None = None) -> None:
        """`registry`, `settings` and `runner_factory` as AsyncEngine takes them."""
        self._engine = AsyncEngine(config, registry=registry, settings=settings, runner_factory=runner_factory)
        self._loop = asyncio.new_event_loop()
        self._closing = asyncio.Event()  # set on the loop: the loop thread shuts the engine down and ends
        self._lock = threading.Lock()  # orders every hand-over before close's
        self._closed = False
        self._shutdown: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=_run_loop, args=(self._loop, self._engine, self._closing,
                                                                self._shutdown),
                                        name="metrale-llm", daemon=True)
        self._thread.start()
        # at exit: close (or, once dropped, wait for the shutdown that __del__ began); see the module docstring
        _register_exit_hook(functools.partial(_close_at_exit, weakref.ref(self), self._thread))
        try:
            self._call(self._engine.start)
        except BaseException:
            self.close()
            raise

    # ---- requests ----

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 progress: bool = False, lora: str | Sequence[str | None] | None = None) -> list[CompletionResult]:
        """Run one prompt or a list of prompts (text or token ids) to the end, batched together;
        the results come back in the prompts' order.

        lora: a registered LoRA adapter's name (`add_lora`) for every prompt, or a list with one name (or
        None: the base model) per prompt; prompts with different adapters run in the same batch.

        params: one SamplingParams for all, or a list with one per prompt. All or nothing: if a prompt
        is rejected, its typed RequestRejectedError is raised and the others are aborted (when the
        list fits the waiting queue, before any step computed them); a request that fails later
        raises RequestFailedError and aborts the others too. A list longer than the room in the
        waiting queue (`max_waiting`) is queued in waves. progress: a line on stderr as requests end."""
        prompts = _as_list(prompts, single=lambda p: isinstance(p, str) or _is_token_ids(p))
        submits = [functools.partial(self._engine.generate, p, sp, lora=adapter)
                   for p, sp, adapter in zip(prompts, _per_prompt(params, prompts), _adapters(lora, prompts))]
        return self._call(self._run_batch, submits, progress)

    def chat(self, messages: Messages | Sequence[Messages],
             params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             progress: bool = False, lora: str | Sequence[str | None] | None = None) -> list[CompletionResult]:
        """`generate` over one conversation (a list of {"role", "content"} messages) or a list of
        conversations, each rendered with the model's chat template (`lora` as `generate` takes it)."""
        conversations = _as_list(messages, single=lambda m: not m or isinstance(m[0], Mapping))
        submits = [functools.partial(self._engine.chat, m, sp, lora=adapter)
                   for m, sp, adapter in zip(conversations, _per_prompt(params, conversations),
                                             _adapters(lora, conversations))]
        return self._call(self._run_batch, submits, progress)

    def embed(self, prompts: Prompt | Sequence[Prompt], params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        """One embedding per prompt (text or token ids), in order, batched together (AsyncEngine.embed: at most
        MAX_EMBED_INPUTS prompts; a rejection queues nothing)."""
        prompts = _as_list(prompts, single=lambda p: isinstance(p, str) or _is_token_ids(p))
        return self._call(self._engine.embed, prompts, params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> "CompletionStream":
        """Queue one request now (a rejection raises here) and return a plain iterator of its
        RequestOutput deltas. See CompletionStream for how ending it early aborts the request."""
        return CompletionStream(self, self._call(_on_loop, self._engine.generate, prompt, params))

    def generate_streaming(self, prompt: Prompt, params: SamplingParams | None,
                           on_token: Callable[[int, str], object]) -> CompletionResult:
        """Run one request, calling `on_token(token_id, text)` in this thread for every generated token,
        and return its CompletionResult. `text` is the text this token completed ("" while a partial
        character or a possible stop string is held back; a delta's text rides on its last token);
        joined, the texts equal the result's. An exception raised by on_token (KeyboardInterrupt too)
        aborts the request, waits until its blocks are free, and propagates."""
        outputs: list[RequestOutput] = []
        with self.stream(prompt, _one_sequence(params)) as deltas:
            for out in deltas:
                outputs.append(out)
                last = len(out.token_ids) - 1
                for i, token_id in enumerate(out.token_ids):
                    on_token(token_id, out.text if i == last else "")
        return CompletionResult.from_outputs(deltas.request_id, outputs)

    async def _run_batch(self, submits: list[Callable[[], RequestStream]], progress: bool) -> list[CompletionResult]:
        """On the loop: queue the requests in order and collect their results. While the waiting queue
        is full, wait for one of this call's own requests to end (a list longer than max_waiting
        runs in waves); otherwise no step runs between two submissions."""
        streams: list[RequestStream] = []
        tasks: list[asyncio.Task[CompletionResult]] = []
        report = _Progress(len(submits)) if progress else None
        try:
            for submit in submits:
                await self._wait_for_room(tasks)
                streams.append(submit())
                tasks.append(asyncio.ensure_future(collect_result(streams[-1])))
                if report is not None:
                    tasks[-1].add_done_callback(report.advance)
            return list(await asyncio.gather(*tasks))
        finally:  # after a rejection, a failure or a cancel: end the others (a no-op once all are done)
            for task in tasks:
                task.cancel()
            for stream in streams:
                await stream.aclose()

    async def _wait_for_room(self, tasks: list[asyncio.Task[CompletionResult]]) -> None:
        """Wait while the waiting queue is full and some of `tasks` are unfinished (with none, the
        submission goes ahead and is refused with QueueFullError)."""
        while self._engine.stats().waiting >= self._engine.config.max_waiting:
            pending = [task for task in tasks if not task.done()]
            if not pending:
                return
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)

    # ---- LoRA adapters ----

    def add_lora(self, name: str, path: str) -> None:
        """Register a LoRA adapter folder (mlx-lm or PEFT) as `name` (InvalidLoraAdapterError if it does not fit)."""
        self._call(self._engine.add_lora, name, path)

    def remove_lora(self, name: str) -> bool:
        """Unregister an adapter; False if unknown."""
        return self._call(_on_loop, self._engine.remove_lora, name)

    # ---- introspection ----

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> EngineStats:
        """A snapshot of the engine; after close() has returned, the stopped engine's last state."""
        return self._read(self._engine.stats)

    def check_integrity(self) -> None:
        """Raise if the engine's KV accounting is inconsistent (after close() too)."""
        self._read(self._engine.check_integrity)

    def _read(self, fn: Callable[[], T]) -> T:
        if self._closed and not self._thread.is_alive():
            return fn()  # the loop thread has ended: nothing else touches the engine any more
        return self._call(_on_loop, fn)

    # ---- the loop thread ----

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `await fn(*args)` on the loop thread and wait for it here; its error is raised here.
        Interrupted while waiting (KeyboardInterrupt), the call is cancelled, which aborts its
        requests, and the interruption propagates."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LLM called from its own loop thread; it would wait for itself")
        with self._lock:
            if self._closed:
                raise EngineNotRunningError("LLM is closed")
            future = asyncio.run_coroutine_threadsafe(fn(*args), self._loop)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise EngineNotRunningError("LLM was closed while this call waited") from None
        except BaseException:
            future.cancel()  # a no-op when the error came from fn itself
            raise

    def close(self) -> None:
        """Abort every unfinished request, stop the engine, the MLX thread and the loop thread, and
        wait for them. Idempotent. Calls still waiting in other threads return their aborted results
        or raise EngineNotRunningError."""
        self._begin_close()
        if threading.current_thread() is not self._thread:
            self._thread.join()
            self._shutdown.result()  # an error of the engine's shutdown is raised here

    def _begin_close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._loop.call_soon_threadsafe(self._closing.set)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Never waits: the loop thread shuts the engine down and ends on its own.
        if hasattr(self, "_thread"):
            self._begin_close()


class CompletionStream:
    """A plain iterator of one request's RequestOutput deltas (from `LLM.stream`).

    Ending it early aborts the request: `close()` and leaving `with llm.stream(...) as deltas:` abort it
    and return once its KV blocks are free; breaking out of (or raising in) `for out in llm.stream(...)`
    drops the iterator at once, which hands the abort to the engine (its blocks are freed at the next
    step boundary). An iterator kept in a variable lives on: close it or use `with`. A failed request
    raises RequestFailedError after its last delta.
    """

    def __init__(self, llm: LLM, stream: RequestStream) -> None:
        self._llm = llm
        self._stream = stream  # dropped unfinished, its own __del__ hands the abort to the loop
        self._ended = False  # the final delta was read, or an error ended the iteration

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    def __iter__(self) -> "CompletionStream":
        return self

    def __next__(self) -> RequestOutput:
        try:
            out = self._llm._call(_next_delta, self._stream)
        except BaseException:  # the request ended (failed, or cancelled: an interrupt aborted it)
            self._ended = True
            raise
        if out is None:
            self._ended = True
            raise StopIteration
        self._ended = self._ended or out.finish_reason is not None
        return out

    def close(self) -> None:
        """Abort the request unless it has ended; returns when its blocks are free."""
        if not self._ended and not self._llm.closed:  # a closed LLM has aborted everything
            self._ended = True
            self._llm._call(_end, self._llm._engine, self._stream)

    def __enter__(self) -> "CompletionStream":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---- on the loop thread ----

def _register_exit_hook(hook: Callable[[], None]) -> None:
    """hook() before the interpreter's threads and default executors shut down (plain atexit where this
    Python lacks threading's hook)."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(hook)
    else:
        register(hook)


def _close_at_exit(llm_ref: "weakref.ref[LLM]", thread: threading.Thread) -> None:
    """The exit hook of an LLM: close it if still open (close is idempotent), or, dropped already (its __del__
    began the shutdown), wait for its loop thread to end."""
    llm = llm_ref()
    if llm is not None and not llm.closed:
        llm.close()
    elif thread.is_alive():  # dropped, or closed from another thread that has not waited yet
        thread.join()


def _run_loop(loop: asyncio.AbstractEventLoop, engine: AsyncEngine, closing: asyncio.Event,
              shutdown: concurrent.futures.Future[None]) -> None:
    """The loop thread: serve calls until `closing` is set, then shut everything down and end."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_serve(engine, closing))
        shutdown.set_result(None)
    except BaseException as error:
        shutdown.set_exception(error)
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())  # AsyncEngine.shutdown's to_thread worker
        loop.close()


async def _serve(engine: AsyncEngine, closing: asyncio.Event) -> None:
    await closing.wait()
    try:
        await engine.shutdown()  # aborts every unfinished request; their collecting calls return
    finally:
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in others:  # calls still waiting (a stream's next delta): their callers get an error
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)


async def _on_loop(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)


async def _next_delta(stream: RequestStream) -> RequestOutput | None:
    """The stream's next delta, or None at its end (StopAsyncIteration cannot cross a future)."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _end(engine: AsyncEngine, stream: RequestStream) -> None:
    """Abort a request and wait for its final delta: its blocks are free when this returns."""
    engine.abort(stream.request_id)
    try:
        async for _ in stream:
            pass
    except RequestFailedError:  # it failed before the abort landed; the consumer asked to stop anyway
        pass


class _Progress:
    """The optional progress line on stderr: "metrale: 3/10 requests done"."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0

    def advance(self, _: asyncio.Future) -> None:
        self.done += 1
        end = "\n" if self.done == self.total else ""
        sys.stderr.write(f"\rmetrale: {self.done}/{self.total} requests done{end}")
        sys.stderr.flush()


# ---- arguments ----

def _is_token_ids(value: object) -> bool:
    return isinstance(value, Sequence) and bool(value) and all(type(t) is int for t in value)


def _as_list(value: Any, single: Callable[[Any], bool]) -> list[Any]:
    return [value] if single(value) else list(value)


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, prompts: list[Any]) -> list[Any]:
    if params is None or isinstance(params, SamplingParams):
        return [_one_sequence(params)] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
    return [_one_sequence(p) for p in params]


def _adapters(lora: str | Sequence[str | None] | None, prompts: list[Any]) -> list[str | None]:
    if lora is None or isinstance(lora, str):
        return [lora] * len(prompts)
    adapters = list(lora)
    if len(adapters) != len(prompts):
        raise ValueError(f"got {len(adapters)} LoRA names for {len(prompts)} prompts; give one, or one per prompt")
    return adapters


def _one_sequence(params: SamplingParams | None) -> SamplingParams | None:
    """The blocking API returns one CompletionResult per prompt: n > 1 is refused before anything is queued."""
    if isinstance(params, SamplingParams) and params.n != 1:
        raise ValueError(f"n must be 1 here (one result per prompt), got {params.n}; "
                         "iterate AsyncEngine.generate for n sequences")
    return params
