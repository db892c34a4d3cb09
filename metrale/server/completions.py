"""POST /v1/completions and /v1/chat/completions: one request -> one engine stream -> JSON or SSE.

    body --decode/validate--> SamplingParams --engine.generate/chat--> RequestStream
         (a list of prompts: one engine request per prompt, read as one PromptBatchStream)
         -> non-streaming: collect deltas, one JSON body      -> streaming: one SSE chunk per delta
    the client disconnects at any point -> the handler task is cancelled -> stream.aclose() aborts

Shapes are OpenAI's: completion chunks are `text_completion` objects, chat chunks are
`chat.completion.chunk` objects whose first delta carries the role; `finish_reason` is non-null
exactly once; with stream_options.include_usage a last chunk has `choices: []` and the usage.
A request the engine aborts (drain timeout) or fails after the response started ends with an SSE
error event, then `data: [DONE]`; before it started, it is a 503 (abort) or 500 (failure).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from metrale.errors import RequestFailedError
from metrale.outputs import RequestOutput, TokenLogprob
from metrale.server import logprobs as lp
from metrale.server import chat_output, protocol, structured, tools
from metrale.server.asgi import Receive, Send, SSEResponse, run_until_disconnect, send_json
from metrale.server.errors import APIError, bad_request, from_engine_error
from metrale.server.prompt_batch import PromptBatchStream
from metrale.server.resolve import ModelResolver, Target
from metrale.server.unknown_fields import UnknownFields
from metrale.engine.protocol import EngineClient

try:
    FINGERPRINT = f"metrale-{version('metrale')}"
except PackageNotFoundError:  # running from a source tree that was never installed
    FINGERPRINT = "metrale-dev"


ABORTED = "request was aborted by the server (shutting down)"


@dataclass(frozen=True, slots=True)
class _Call:
    """What every response object of one request shares."""

    chat: bool
    id: str
    created: int
    model: str
    include_usage: bool
    logprobs: int | None  # None: not requested
    plan: chat_output.OutputPlan | None = None  # chat with reasoning or tool parsing (metrale.server.chat_output)
    n: int = 1  # choices: n_per_prompt for each prompt
    echo: str | None = None  # completions with echo: the prompt text each choice starts with
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (top alternatives), None: not requested
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: the usage so far on every chunk
    prompt_tail: str = ""  # the prompt's last tokens as text: where a reasoning block stands
    n_per_prompt: int = 0  # the request's n when it has a list of prompts (0: one prompt, n_per_prompt == n)

    def envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT}


class _Choice:
    """One output sequence of the response: its text, logprobs and parser state, by delta."""

    def __init__(self, index: int, call: _Call) -> None:
        self.index = index
        self.tools = call.plan.stream(call.prompt_tail) if call.plan is not None else None
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.last: RequestOutput | None = None
        self.echoed = False  # streaming: the prompt went out with the first delta
        self.role_sent = False  # streaming chat: the role goes out with the first token, as vLLM sends it

    def add(self, out: RequestOutput) -> None:
        self.texts.append(out.text)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        self.last = out

    def render(self, engine: EngineClient, call: _Call, prompt_logprobs: list | None) -> dict[str, Any]:
        """The non-streamed choice object."""
        text = "".join(self.texts)
        last = self.last
        choice: dict[str, Any] = {"index": self.index, "logprobs": None, "finish_reason": last.finish_reason}
        if call.logprobs is not None:
            choice["logprobs"] = _logprobs(engine, call, self.logprobs, prompt_logprobs if call.echo is not None else None)
        if call.chat and self.tools is not None:
            choice["message"] = self.tools.message(text)
            choice["finish_reason"] = self.tools.finish_reason(last.finish_reason)
        elif call.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = (call.echo or "") + text
            if call.prompt_logprobs is not None:
                choice["prompt_logprobs"] = lp.render_prompt(engine, prompt_logprobs, call.prompt_logprobs)
        return choice


async def handle(models: ModelResolver, body: bytes, chat: bool, send: Send, receive: Receive, *,
                 default_max_tokens: int | None, request_id: str | None = None,
                 tool_call_format: str | None = None,
                 reasoning_parser: str | None = None, unknown_fields: UnknownFields | None = None) -> None:
    """Serve one completion request; raises APIError for anything refused before the response.
    `request_id` (the client's X-Request-Id) names the engine request; else the body's request_id (vLLM's
    field, which also makes the response id), else the response id.
    `tool_call_format` overrides the format the engine reads from the model's chat template, and
    `reasoning_parser` its reasoning format ("none": reasoning stays in content);
    `models` resolves the request's model; `unknown_fields` counts the body's fields that no struct declares."""
    kind = protocol.ChatCompletionRequest if chat else protocol.CompletionRequest
    request = protocol.decode(body, kind)
    if unknown_fields is not None:
        unknown_fields.check(body, kind, "/v1/chat/completions" if chat else "/v1/completions")
    check_before_loading(models, request, default_max_tokens)
    target = await models.resolve(request.model)
    call, stream = await open_stream(target, request, default_max_tokens=default_max_tokens,
                                     request_id=request_id, tool_call_format=tool_call_format,
                                     reasoning_parser=reasoning_parser or "auto")
    respond = _stream_response if request.stream else _full_response
    try:
        await run_until_disconnect(respond(target.engine, call, stream, send), receive)
    finally:
        await stream.aclose()  # no-op once finished; aborts the request on disconnect or error


def check_before_loading(models: ModelResolver, request: protocol.CompletionRequest | protocol.ChatCompletionRequest,
                         default_max_tokens: int | None) -> None:
    """On a server that loads models on demand, a 400 for bad sampling fields before the request's model is
    resolved (and maybe loaded): the model's sampling defaults only fill fields a request leaves unset, so a
    request refused without them is refused with them too. A resident model needs no early check."""
    if models.loads_on_demand:
        protocol.sampling_params(request, default_max_tokens)


async def open_stream(target: Target, request: protocol.CompletionRequest | protocol.ChatCompletionRequest, *,
                      default_max_tokens: int | None, request_id: str | None = None,
                      tool_call_format: str | None = None, reasoning_parser: str = "none") -> tuple[_Call, Any]:
    """Validate a decoded request, render and tokenize its prompt (off the event loop when long) and submit
    it to the engine of `target` (what the request's model resolved to): the fields its response objects share,
    and the engine stream (the caller closes it). Raises
    APIError for anything refused. The Anthropic and Ollama routes come here too, with their bodies
    translated into a ChatCompletionRequest. `reasoning_parser`: "auto" reads reasoning as the chat template
    shows it, a metrale.text.reasoning format forces one, "none" (what the other routes get) leaves it in content."""
    chat = isinstance(request, protocol.ChatCompletionRequest)
    engine, model = target.engine, target.model_id
    params = protocol.sampling_params(request, default_max_tokens, engine.sampling_defaults)
    model_format = tool_call_format or engine.tool_call_format
    plan = tools.plan(request, model_format) if chat else None
    reasoning = chat_output.reasoning_format(None if reasoning_parser == "auto" else reasoning_parser, engine)
    output = chat_output.output_plan(plan, reasoning, request.include_reasoning is not False) if chat else None
    if plan is not None:
        params = plan.params(params)
    if output is not None:
        params = output.params(params)
    await prepare_params(engine, params, "tools" if plan is not None and plan.constrains_output
                   else structured.source_of(request))
    options = request.stream_options
    include_usage = options is not None and (options.include_usage or options.continuous_usage_stats)
    with engine_errors(protocol.CHAT_FIELDS if chat else protocol.COMPLETION_FIELDS):
        if chat:
            prompt_ids = await _chat_prompt_ids(engine, request, plan, model_format)
        else:
            prompts = protocol.completion_prompts(request)
            if len(prompts) > 1:
                return await _open_batch(engine, model, request, params, prompts, request_id, target.adapter)
            prompt = prompts[0]
            prompt_ids = await engine.prompt_token_ids(prompt)
        echo = None
        if not chat and request.echo:
            echo = prompt if isinstance(prompt, str) else engine.decode(prompt_ids)
        call = _Call(chat, f"{'chatcmpl' if chat else 'cmpl'}-{request.request_id or uuid.uuid4().hex}",
                     int(time.time()), model,
                     include_usage, params.logprobs,
                     output, params.n, echo, tuple(prompt_ids), request.prompt_logprobs,
                     continuous_usage=options is not None and options.continuous_usage_stats,
                     prompt_tail=chat_output.prompt_tail(engine, prompt_ids) if output is not None else "")
        stream = engine.generate(prompt_ids, params, request_id=request_id or request.request_id or call.id,
                                 lora=target.adapter)
    return call, stream


async def _open_batch(engine: EngineClient, model: str, request: protocol.CompletionRequest, params: Any,
                      prompts: list[str | list[int]], request_id: str | None,
                      lora: str | None = None) -> tuple[_Call, PromptBatchStream]:
    """A list of prompts: every prompt tokenized (off the event loop when long) before any is submitted, then
    one engine request per prompt, `{id}-{i}`; one submit refused closes those already queued."""
    for field in ("echo", "prompt_logprobs"):
        if getattr(request, field) is not None and getattr(request, field) is not False:  # 0 asks too
            raise bad_request(f"{field} is not supported with a list of prompts; send one request per prompt",
                              field)
    prompt_ids = [await engine.prompt_token_ids(prompt) for prompt in prompts]
    options = request.stream_options
    call = _Call(False, f"cmpl-{request.request_id or uuid.uuid4().hex}", int(time.time()), model,
                 options is not None and (options.include_usage or options.continuous_usage_stats),
                 params.logprobs, n=params.n * len(prompts), n_per_prompt=params.n,
                 continuous_usage=options is not None and options.continuous_usage_stats)
    base_id = request_id or request.request_id or call.id
    streams: list[Any] = []
    try:
        for i, ids in enumerate(prompt_ids):
            streams.append(engine.generate(ids, params, request_id=f"{base_id}-{i}", lora=lora))
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return call, PromptBatchStream(streams, params.n)


async def prompt_token_ids(engine: EngineClient, request: protocol.ChatCompletionRequest) -> list[int]:
    """The token ids a chat request's prompt renders to (its tools included), as open_stream would submit."""
    plan = tools.plan(request, engine.tool_call_format)
    with engine_errors(protocol.CHAT_FIELDS):
        return await _chat_prompt_ids(engine, request, plan, engine.tool_call_format)


@contextmanager
def engine_errors(renames: Mapping[str, str] | None = None) -> Iterator[None]:
    """The engine's submit-time errors (typed rejections, bad params) as APIErrors; others propagate.
    `renames`: the engine's parameter names as the route calls them (protocol.CHAT_FIELDS, ...)."""
    try:
        yield
    except APIError:
        raise
    except Exception as error:
        api_error = from_engine_error(error, renames)
        if api_error is None:
            raise
        raise api_error from error


async def _chat_prompt_ids(engine: EngineClient, request: protocol.ChatCompletionRequest,
                           plan: tools.ToolPlan | None, model_format: str | None) -> list[int]:
    """Long prompts are tokenized off the event loop."""
    return await engine.chat_token_ids(tools.template_messages(protocol.chat_messages(request), plan, model_format),
                                       tools=plan.template_tools if plan is not None else None,
                                       **protocol.template_kwargs(request))


async def read_whole(stream: Any, feed: Callable[[RequestOutput], Any]) -> RequestOutput:
    """Feed every delta of a non-streamed response to `feed`; the last delta. A failed request is a 500, an
    aborted one a 503 (the Anthropic and Ollama routes answer this way too)."""
    last = None
    try:
        async for out in stream:
            feed(out)
            last = out
    except RequestFailedError as error:
        raise APIError(500, str(error), code="request_failed") from error
    if last is None or last.finish_reason == "abort":
        raise APIError(503, ABORTED, code="aborted")
    return last


async def prepare_params(engine: EngineClient, params: Any, source: str) -> None:
    """Compile the request's grammar off the event loop; a bad one is a 400 naming its field."""
    try:
        await engine.prepare(params)
    except Exception as error:
        api_error = structured.prepare_error(error, source)
        if api_error is None:
            raise
        raise api_error from error


async def _full_response(engine: EngineClient, call: _Call, stream: Any, send: Send) -> None:
    choices = [_Choice(i, call) for i in range(call.n)]
    prompt_logprobs = None
    try:
        async for out in stream:
            choices[out.index].add(out)
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs
    except RequestFailedError as error:
        raise APIError(500, str(error), code="request_failed") from error
    if any(c.last is None or c.last.finish_reason == "abort" for c in choices):
        raise APIError(503, ABORTED, code="aborted")
    body = {**call.envelope(chunk=False), "choices": [c.render(engine, call, prompt_logprobs) for c in choices],
            "usage": _usage(choices, call)}
    if call.chat and call.prompt_logprobs is not None:  # vLLM puts a chat response's at the top level
        body["prompt_logprobs"] = lp.render_prompt(engine, prompt_logprobs, call.prompt_logprobs)
    await send_json(send, 200, body)


async def _stream_response(engine: EngineClient, call: _Call, stream: Any, send: Send) -> None:
    sse = SSEResponse(send)
    await sse.start()
    choices = [_Choice(i, call) for i in range(call.n)]
    failed = False
    prompt_logprobs = None  # sequence 0's first delta brings them (before any other sequence's)
    try:
        async for out in stream:
            choice = choices[out.index]
            choice.last = out
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs
            if out.finish_reason in ("abort", "error"):
                continue  # abort: reported below; error: the stream raises next
            if out.text or out.finish_reason is not None or out.logprobs or (call.echo is not None and not choice.echoed):
                usage = _usage(choices, call) if call.continuous_usage else None
                await _send_delta(engine, sse, call, choice, out, prompt_logprobs, usage)
    except RequestFailedError as error:
        failed = True
        await sse.event(APIError(500, str(error), code="request_failed").body())
    if not failed:
        if any(c.last is None or c.last.finish_reason == "abort" for c in choices):
            await sse.event(APIError(503, ABORTED, code="aborted").body())
        elif call.include_usage:
            await sse.event({**call.envelope(chunk=True), "choices": [], "usage": _usage(choices, call)})
    await sse.done()


async def _send_delta(engine: EngineClient, sse: SSEResponse, call: _Call, choice: _Choice,
                      out: RequestOutput, prompt_logprobs: list | None, usage: dict[str, Any] | None) -> None:
    """The chunks of one delta; `usage` (the usage so far) goes on each when the client asked for it."""

    def chunk(content: Any, finish_reason: str | None, logprobs: Any = None) -> dict[str, Any]:
        return _chunk(call, choice.index, content, finish_reason, logprobs, usage)

    logprobs = None
    if not call.chat:
        text = out.text
        if call.echo is not None and not choice.echoed:  # the prompt goes first, with its logprobs
            choice.echoed = True
            text = call.echo + text
            if call.logprobs is not None:
                logprobs = _logprobs(engine, call, out.logprobs or [], prompt_logprobs)
        elif call.logprobs is not None and out.logprobs:
            logprobs = _logprobs(engine, call, out.logprobs, None)
        await sse.event(chunk(text, out.finish_reason, logprobs))
        return
    if not choice.role_sent:
        choice.role_sent = True
        await sse.event(chunk({"role": "assistant", "content": ""}, None))
    if call.logprobs is not None and out.logprobs:
        logprobs = lp.render(engine, out.logprobs, True, call.logprobs)
    if choice.tools is not None:  # content and tool-call deltas, as the parser makes them certain
        fields = choice.tools.delta(out.text, final=out.finish_reason is not None)
        if fields or logprobs:
            await sse.event(chunk(fields, None, logprobs))
        if out.finish_reason is not None:
            await sse.event(chunk({}, choice.tools.finish_reason(out.finish_reason)))
        return
    if out.text or logprobs:
        await sse.event(chunk({"content": out.text}, None, logprobs))
    if out.finish_reason is not None:
        await sse.event(chunk({}, out.finish_reason))


def _logprobs(engine: EngineClient, call: _Call, logprobs: list[TokenLogprob],
              prompt_logprobs: list | None) -> dict[str, Any]:
    """A choice's logprobs object; with echo (`prompt_logprobs` given) the prompt's tokens come first."""
    if prompt_logprobs is None:
        return lp.render(engine, logprobs, call.chat, call.logprobs)
    return lp.render(engine, [*prompt_logprobs[1:], *logprobs], False, call.logprobs,
                     leading_token_id=call.prompt_token_ids[0])


def _chunk(call: _Call, index: int, content: Any, finish_reason: str | None, logprobs: Any = None,
           usage: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
    choice["delta" if call.chat else "text"] = content
    chunk = {**call.envelope(chunk=True), "choices": [choice]}
    if call.include_usage:
        chunk["usage"] = usage  # null on every chunk but the last, unless continuous usage was asked for
    return chunk


def _usage(choices: list[_Choice], call: _Call) -> dict[str, Any]:
    """The usage of the deltas seen so far (all of them once every choice finished): each prompt counted once
    for its n choices, summed over the prompts; the completion tokens of every choice."""
    per_prompt = call.n_per_prompt or call.n
    num_prompt = num_cached = num_output = 0
    for start in range(0, len(choices), per_prompt):
        seen = [c.last for c in choices[start:start + per_prompt] if c.last is not None]
        if seen:
            num_prompt += seen[0].num_prompt_tokens
            num_cached += seen[0].num_cached_tokens
        num_output += sum(out.num_output_tokens for out in seen)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": num_cached}}
