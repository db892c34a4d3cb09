"""Submission: a prompt and its params in, a queued request and its stream out, or a typed refusal.

Synchronous and on the event loop, except that long prompts are tokenized on one worker thread. A refusal
(metrale.errors) changes nothing and is counted once, by the reason its type carries (`counting_rejections`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from metrale.engine.ipc import ModelFacts
from metrale.engine.metrics import EngineMetrics
from metrale.engine.startup import TextFrontEnd
from metrale.engine.stream import GroupStream, OutputChannel, RequestStream
from metrale.engine.streams import RequestStreams
from metrale.errors import (DuplicateRequestError, EngineUnavailableError, InvalidParamsError, PromptTooLongError,
                            RequestFailedError, RequestRejectedError,
                            StructuredOutputUnavailableError)
from metrale.outputs import CompletionResult, EmbeddingOutput
from metrale.pooling_params import MAX_EMBED_INPUTS, PoolingParams
from metrale.sampling.guided import require_llguidance
from metrale.sampling_params import SamplingParams
from scheduler import LoraRef

OFF_LOOP_PROMPT_CHARS = 16 * 1024  # longer prompts are tokenized on a worker thread (async paths)
OFF_LOOP_TEXT_PARAMS_CHARS = 256  # more bad words / stop strings are prepared on that thread (prepare)
Abort = Callable[..., bool]  # AsyncEngine.abort(request_id, channel=...)


@contextlib.contextmanager
def counting_rejections(metrics: EngineMetrics) -> Iterator[None]:
    """Every refusal at submit time is counted once, by the reason its type carries."""
    try:
        yield
    except (RequestRejectedError, EngineUnavailableError) as error:
        if error.reason is not None:
            metrics.record_rejected(error.reason)
        raise
    except (ValueError, TypeError):  # e.g. params that are not SamplingParams
        metrics.record_rejected("invalid_request")
        raise


class Submission:
    """Validates, tokenizes and queues the requests of one started engine: `client` is its engine core
    (metrale.engine.core_host.LocalCore, or the engine process's EngineProcess), `streams` the text
    front-end of its open requests."""

    def __init__(self, text: TextFrontEnd, client, facts: ModelFacts, streams: RequestStreams,
                 max_model_len: int, abort: Abort) -> None:
        self.inputs = text.inputs
        self._outputs = text.outputs
        self._client = client
        self._facts = facts
        self._streams = streams
        self._max_model_len = max_model_len
        self._abort = abort
        self._ids = itertools.count()
        self._tokenize_thread: ThreadPoolExecutor | None = None

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None, request_id: str | None,
                 priority: int, lora: LoraRef | None = None) -> RequestStream | GroupStream:
        params = self._request_params(params)
        return self.submit(self.inputs.prompt_ids(prompt), params, request_id, priority, lora)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None, request_id: str | None,
             priority: int, tools: Sequence[Any] | None, lora: LoraRef | None = None) -> RequestStream | GroupStream:
        params = self._request_params(params)
        return self.submit(self.inputs.chat_ids(messages, tools=tools), params, request_id, priority, lora)

    async def prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str) and len(prompt) > OFF_LOOP_PROMPT_CHARS:
            self.inputs.check_length(prompt)
            return await self._off_loop(self.inputs.prompt_ids, prompt)
        return self.inputs.prompt_ids(prompt)

    async def chat_token_ids(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        size = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict)) \
            if isinstance(messages, list) else 0
        if size > OFF_LOOP_PROMPT_CHARS:
            return await self._off_loop(self.inputs.chat_ids, messages, **template_kwargs)
        return self.inputs.chat_ids(messages, **template_kwargs)

    async def prepare(self, params: SamplingParams) -> None:
        if prepares_text(params):
            await self._off_loop(self.inputs.prepare, params)
        if params.structured_outputs is not None:
            self._check_grammars()
            await self._client.compile(params.structured_outputs)

    async def embed(self, prompts: Sequence[str | Sequence[int]], params: PoolingParams | None, request_id: str | None,
                    priority: int) -> list[RequestStream]:
        """Queue one embedding request per prompt (ids `request_id-i`) and return their streams. Everything is
        checked first (count, dimensions, tokens, lengths) so that a bad input queues nothing; a refusal while
        queueing (the waiting queue is full) aborts the ones queued before any step computed them."""
        params = self._pooling_params(params, len(prompts))
        limit = self._max_model_len - 1  # the scheduler holds room for one token after the prompt
        prompts = [self._bounded_text(p, params) if isinstance(p, str) else p for p in prompts]  # before any tokenizing
        if sum(len(p) for p in prompts if isinstance(p, str)) > OFF_LOOP_PROMPT_CHARS:  # many or long texts
            encoded = await self._off_loop(lambda: [self.inputs.prompt_ids(p) for p in prompts])
        else:
            encoded = [self.inputs.prompt_ids(p) for p in prompts]
        ids = [_truncated(prompt_ids, params, limit) for prompt_ids in encoded]
        too_long = [(i, len(p)) for i, p in enumerate(ids) if len(p) > limit]
        if too_long:
            index, length = too_long[0]
            raise PromptTooLongError(f"input {index} is too large: {length} tokens; an embedding input may have at "
                                     f"most {limit} (max_model_len {self._max_model_len} - 1); set "
                                     f"truncate_prompt_tokens to keep its last tokens")
        base = request_id if request_id is not None else f"embd-{next(self._ids)}"
        streams: list[RequestStream] = []
        try:
            for index, prompt_ids in enumerate(ids):
                streams.append(self._submit_pooled(f"{base}-{index}", prompt_ids, params, priority))
        except BaseException:
            for stream in streams:
                await stream.aclose()  # aborted before any step computed it
            raise
        return streams

    def _bounded_text(self, text: str, params: PoolingParams) -> str:
        """`text`, or when it is longer than max_model_len tokens can hold, a PromptTooLongError (no truncation) or
        the end that truncation keeps, cut before tokenizing: max_prompt_chars characters hold at least max_model_len
        tokens (a token spans at most the longest vocabulary entry), so the ids kept are the whole text's but for a
        word split at the cut, which only a text of nothing but the longest tokens would reach."""
        bound = self.inputs.max_prompt_chars
        if bound is None or len(text) <= bound:
            return text
        if params.truncate_prompt_tokens is None:
            self.inputs.check_length(text)  # raises
        return text[:bound] if params.truncation_side == "right" else text[-bound:]

    def _pooling_params(self, params: PoolingParams | None, num_prompts: int) -> PoolingParams:
        if params is None:
            params = PoolingParams()
        if not isinstance(params, PoolingParams):
            raise TypeError(f"params must be PoolingParams, got {type(params).__name__}")
        limit = min(MAX_EMBED_INPUTS, self._client.config.max_waiting)  # each input waits as one request
        if not 1 <= num_prompts <= limit:
            raise InvalidParamsError(f"input must hold 1 to {limit} inputs (the most the waiting queue holds, "
                                     f"max_waiting {self._client.config.max_waiting}), got {num_prompts}"
                                     if limit < MAX_EMBED_INPUTS else
                                     f"input must hold 1 to {limit} inputs, got {num_prompts}", field="input")
        if params.dimensions is not None:
            if not self._client.config.matryoshka:
                raise InvalidParamsError(f"model {self._facts.model_name!r} does not support matryoshka "
                                         f"representation; changing output dimensions would give poor results "
                                         f"(start the engine with matryoshka=True if it was trained for it)",
                                         field="dimensions")
            if params.dimensions > self._facts.hidden_size:
                raise InvalidParamsError(f"dimensions must be at most the model's hidden size "
                                         f"({self._facts.hidden_size}), got {params.dimensions}", field="dimensions")
        return params

    def _submit_pooled(self, request_id: str, prompt_ids: list[int], params: PoolingParams,
                       priority: int) -> RequestStream:
        if request_id in self._streams:
            raise DuplicateRequestError(f"request {request_id!r} is already in flight")
        sampling = SamplingParams(max_tokens=1)
        text = self._outputs.new_request(prompt_ids, sampling, request_id)
        self._client.submit_group([request_id], prompt_ids, [sampling], priority=priority, eos_token_ids=(),
                                  max_tokens=1, num_open=len(self._streams), pooling=params)
        channel = self._streams.open([request_id], [text], len(prompt_ids))[0]
        return RequestStream(channel, functools.partial(self._abort, channel=channel))

    def _check_grammars(self) -> None:
        require_llguidance()
        if not self._facts.has_grammar_compiler:
            raise StructuredOutputUnavailableError("structured outputs need a tokenizer with an eos token")

    def close(self) -> None:
        if self._tokenize_thread is not None:
            self._tokenize_thread.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn, *args: Any, **kwargs: Any) -> Any:
        if self._tokenize_thread is None:  # one thread: a flood of huge prompts queues, it does not fan out
            self._tokenize_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrale-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_thread,
                                                                functools.partial(fn, *args, **kwargs))

    def _request_params(self, params: SamplingParams | None) -> SamplingParams:
        params = _checked_params(params)
        max_num_seqs = self._client.config.max_num_seqs
        if params.n > max_num_seqs:  # before anything is built per sequence
            raise InvalidParamsError(f"n must be at most max_num_seqs ({max_num_seqs}), got {params.n}", field="n")
        params = self.inputs.params(params)
        if params.structured_outputs is not None:
            self._check_grammars()
            self._client.precompile(params.structured_outputs)  # starts compiling now (cached)
        return params

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None,
               priority: int, lora: LoraRef | None = None) -> RequestStream | GroupStream:
        """One sequence (a RequestStream), or params.n sequences sharing the prompt (a GroupStream whose
        deltas carry their sequence's index; sequence i is request `request_id#i`, 0 is `request_id`),
        with the LoRA adapter `lora` (None: the base model)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        max_tokens = self._max_tokens(params, len(prompt_ids))
        eos = self.inputs.tokenizer.eos_token_ids
        if params.n == 1:
            ids, sequences = [request_id], [params]
        else:
            ids = [request_id, *(f"{request_id}#{i}" for i in range(1, params.n))]
            sequences = [params.for_sequence(i) for i in range(params.n)]
        for rid in ids:
            if rid in self._streams:
                raise DuplicateRequestError(f"request {rid!r} is already in flight")
        texts = [self._outputs.new_request(prompt_ids, p, rid) for rid, p in zip(ids, sequences)]
        self._client.submit_group(ids, prompt_ids, sequences, priority=priority, eos_token_ids=eos,
                                  max_tokens=max_tokens, num_open=len(self._streams), lora=lora)
        channels = self._streams.open(ids, texts, len(prompt_ids))
        if params.n == 1:
            return RequestStream(channels[0], functools.partial(self._abort, channel=channels[0]))
        return GroupStream(channels, _abort_channel(self._abort))

    def _max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """params.max_tokens, or when it is None the room left in the context and in the KV pool."""
        if params.max_tokens is not None:
            return params.max_tokens
        pool_tokens = self._facts.kv_slots
        room = min(self._max_model_len - num_prompt_tokens, pool_tokens + 1 - num_prompt_tokens)
        if room < 1:
            raise PromptTooLongError(f"prompt ({num_prompt_tokens} tokens) leaves no room for output in "
                                     f"max_model_len ({self._max_model_len})")
        return max(room, params.min_tokens)


async def collect_result(stream: RequestStream) -> CompletionResult:
    """Read a stream to its end into one CompletionResult; leaving early (an error, a cancel) aborts
    the request."""
    async with stream:
        outputs = [out async for out in stream]
    return CompletionResult.from_outputs(stream.request_id, outputs)


async def collect_embeddings(streams: Sequence[RequestStream]) -> list[EmbeddingOutput]:
    """Each stream's vector, in order. Leaving early (a failed input, a cancel) aborts every one still open."""
    results = []
    try:
        for stream in streams:
            last = None
            async for out in stream:
                last = out
            if last is None or last.embedding is None:
                raise RequestFailedError(stream.request_id, f"ended ({last.finish_reason if last else 'abort'}) "
                                                            f"without its embedding")
            results.append(EmbeddingOutput(stream.request_id, last.embedding, last.num_prompt_tokens))
    finally:
        for stream in streams:
            await stream.aclose()  # a no-op for the ones that ended
    return results


def _truncated(ids: list[int], params: PoolingParams, max_len: int) -> list[int]:
    """The last (truncation_side "left") or first ("right") `truncate_prompt_tokens` ids (-1: the most an input may
    hold, `max_len`), or all of them when it is None."""
    truncate = params.truncate_prompt_tokens
    if truncate is None:
        return ids
    keep = max_len if truncate == -1 else truncate
    if len(ids) <= keep:
        return ids
    return ids[:keep] if params.truncation_side == "right" else ids[-keep:]


def _abort_channel(abort: Abort) -> Callable[[OutputChannel], bool]:
    return lambda channel: abort(channel.request_id, channel=channel)


def prepares_text(params: SamplingParams) -> bool:
    """True when the bad words and stop strings are long enough to tokenize / compile off the event loop."""
    chars = sum(map(len, params.bad_words or ())) + sum(map(len, params.stop_strings))
    return chars > OFF_LOOP_TEXT_PARAMS_CHARS


def _checked_params(params: SamplingParams | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    return params
