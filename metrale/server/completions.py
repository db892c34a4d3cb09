"""POST /v1/completions and /v1/chat/completions: one request -> one engine stream -> JSON or SSE.

    body --decode/validate--> SamplingParams --engine.generate/chat--> RequestStream
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
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from metrale.errors import RequestFailedError
from metrale.outputs import RequestOutput
from metrale.server import logprobs as lp
from metrale.server import protocol, structured, tools
from metrale.server.asgi import Receive, Send, SSEResponse, run_until_disconnect, send_json
from metrale.server.errors import APIError, from_engine_error
from metrale.engine.protocol import EngineClient
from metrale.engine.stream import RequestStream

try:
    FINGERPRINT = f"metrale-{version('metrale')}"
except PackageNotFoundError:  # running from a source tree that was never installed
    FINGERPRINT = "metrale-dev"


_ABORTED = "request was aborted by the server (shutting down)"


@dataclass(frozen=True, slots=True)
class _Call:
    """What every response object of one request shares."""

    chat: bool
    id: str
    created: int
    model: str
    include_usage: bool
    logprobs: int | None  # None: not requested
    tools: tools.ToolCallStream | None = None  # chat with tool parsing (metrale.server.tools)

    def envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT}


async def handle(engine: EngineClient, served_model: str, body: bytes, chat: bool, send: Send, receive: Receive, *,
                 default_max_tokens: int | None, request_id: str | None = None,
                 tool_call_format: str | None = None, model_aliases: tuple[str, ...] = ()) -> None:
    """Serve one completion request; raises APIError for anything refused before the response.
    `request_id` (the client's X-Request-Id) names the engine request; else the response id does.
    `tool_call_format` overrides the format the engine reads from the model's chat template;
    `model_aliases` are other model ids answered as the served one."""
    request = protocol.decode(body, protocol.ChatCompletionRequest if chat else protocol.CompletionRequest)
    model = protocol.model_or_404(request.model, served_model, model_aliases)
    params = protocol.sampling_params(request, default_max_tokens)
    plan = tools.plan(request, tool_call_format or engine.tool_call_format) if chat else None
    if plan is not None:
        params = plan.params(params)
    await _prepare(engine, params, "tools" if plan is not None and plan.choice in ("required", "named")
                   else structured.source_of(request))
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    call = _Call(chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), model,
                 include_usage, params.logprobs, plan.stream() if plan is not None else None)
    try:
        if chat:  # long prompts are tokenized off the event loop
            prompt_ids = await engine.chat_token_ids(tools.template_messages(protocol.chat_messages(request)),
                                                     tools=plan.template_tools if plan is not None else None)
        else:
            prompt_ids = await engine.prompt_token_ids(protocol.completion_prompt(request))
        stream = engine.generate(prompt_ids, params, request_id=request_id or call.id)
    except APIError:
        raise
    except Exception as error:
        api_error = from_engine_error(error, protocol.PARAM_NAMES)
        if api_error is None:
            raise
        raise api_error from error
    respond = _stream_response if request.stream else _full_response
    try:
        await run_until_disconnect(respond(engine, call, stream, send), receive)
    finally:
        await stream.aclose()  # no-op once finished; aborts the request on disconnect or error


async def _prepare(engine: EngineClient, params: Any, source: str) -> None:
    """Compile the request's grammar off the event loop; a bad one is a 400 naming its field."""
    try:
        await engine.prepare(params)
    except Exception as error:
        api_error = structured.prepare_error(error, source)
        if api_error is None:
            raise
        raise api_error from error


async def _full_response(engine: EngineClient, call: _Call, stream: RequestStream, send: Send) -> None:
    texts: list[str] = []
    logprobs: list = []
    last: RequestOutput | None = None
    try:
        async for out in stream:
            texts.append(out.text)
            if out.logprobs:
                logprobs.extend(out.logprobs)
            last = out
    except RequestFailedError as error:
        raise APIError(500, str(error), code="request_failed") from error
    if last is None or last.finish_reason == "abort":
        raise APIError(503, _ABORTED, code="aborted")
    text = "".join(texts)
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
    if call.logprobs is not None:
        choice["logprobs"] = lp.render(engine, logprobs, call.chat, call.logprobs)
    if call.chat and call.tools is not None:
        choice["message"] = call.tools.message(text)
        choice["finish_reason"] = call.tools.finish_reason(last.finish_reason)
    elif call.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    await send_json(send, 200, {**call.envelope(chunk=False), "choices": [choice], "usage": _usage(last)})


async def _stream_response(engine: EngineClient, call: _Call, stream: RequestStream, send: Send) -> None:
    sse = SSEResponse(send)
    await sse.start()
    if call.chat:
        await sse.event(_chunk(call, {"role": "assistant", "content": ""}, None))
    last: RequestOutput | None = None
    try:
        async for out in stream:
            last = out
            if out.finish_reason in ("abort", "error"):
                continue  # abort: reported below; error: the stream raises next
            if out.text or out.finish_reason is not None or out.logprobs:
                await _send_delta(engine, sse, call, out)
    except RequestFailedError as error:
        await sse.event(APIError(500, str(error), code="request_failed").body())
    else:
        if last is None or last.finish_reason == "abort":
            await sse.event(APIError(503, _ABORTED, code="aborted").body())
        elif call.include_usage:
            await sse.event({**call.envelope(chunk=True), "choices": [], "usage": _usage(last)})
    await sse.done()


async def _send_delta(engine: EngineClient, sse: SSEResponse, call: _Call, out: RequestOutput) -> None:
    logprobs = None
    if call.logprobs is not None and out.logprobs:
        logprobs = lp.render(engine, out.logprobs, call.chat, call.logprobs)
    if not call.chat:
        await sse.event(_chunk(call, out.text, out.finish_reason, logprobs))
        return
    if call.tools is not None:  # content and tool-call deltas, as the parser makes them certain
        fields = call.tools.delta(out.text, final=out.finish_reason is not None)
        if fields or logprobs:
            await sse.event(_chunk(call, fields, None, logprobs))
        if out.finish_reason is not None:
            await sse.event(_chunk(call, {}, call.tools.finish_reason(out.finish_reason)))
        return
    if out.text or logprobs:
        await sse.event(_chunk(call, {"content": out.text}, None, logprobs))
    if out.finish_reason is not None:
        await sse.event(_chunk(call, {}, out.finish_reason))


def _chunk(call: _Call, content: Any, finish_reason: str | None, logprobs: Any = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
    choice["delta" if call.chat else "text"] = content
    chunk = {**call.envelope(chunk=True), "choices": [choice]}
    if call.include_usage:
        chunk["usage"] = None
    return chunk


def _usage(out: RequestOutput) -> dict[str, int]:
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens}
