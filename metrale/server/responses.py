"""POST /v1/responses: OpenAI's Responses API over the chat machinery, streamed or not.

    body -> ResponsesRequest (responses_protocol.py) -> chat messages, tools, SamplingParams
         -> engine stream -> output items: a "reasoning" item (the model's <think> text, split by the
            reasoning parser), a "message" with output_text, and "function_call" items

Streaming sends named SSE events, each with a sequence_number, and no [DONE]:

    response.created  response.in_progress
    per reasoning item: response.output_item.added  response.reasoning_text.delta ...
                        response.reasoning_text.done  response.output_item.done
    per message item:   response.output_item.added  response.content_part.added
                        response.output_text.delta ...  response.output_text.done
                        response.content_part.done  response.output_item.done
    per function call:  response.output_item.added  response.function_call_arguments.delta ...
                        response.function_call_arguments.done  response.output_item.done
    response.completed (status "completed"), or response.incomplete (max_output_tokens reached),
    or response.failed (the request failed or was aborted), with the whole response object.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from metrale.errors import RequestFailedError
from metrale.outputs import RequestOutput
from metrale.server import chat_output, protocol, tools
from metrale.server import responses_protocol as rp
from metrale.server.asgi import Receive, Send, SSEResponse, run_until_disconnect, send_json
from metrale.server.completions import ABORTED, prepare_params
from metrale.server.unknown_fields import UnknownFields
from metrale.server.errors import APIError, from_engine_error
from metrale.server.resolve import ModelResolver



def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """The response object of one request, as it grows."""

    def __init__(self, request: rp.ResponsesRequest, model: str) -> None:
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.request = request
        self.model = model
        self.output: list[dict[str, Any]] = []

    def body(self, status: str, last: RequestOutput | None = None, error: dict[str, str] | None = None) -> dict[str, Any]:
        request = self.request
        usage = None
        if last is not None:
            usage = {"input_tokens": last.num_prompt_tokens,
                     "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
                     "output_tokens": last.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": last.num_prompt_tokens + last.num_output_tokens}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": list(self.output), "usage": usage, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p, "tools": request.tools or [],
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "parallel_tool_calls": request.parallel_tool_calls is not False, "metadata": request.metadata or {},
            "text": request.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
            "user": request.user, "previous_response_id": None, "reasoning": None,
        }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" or text else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text or status != "in_progress" else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


async def handle(models: ModelResolver, body: bytes, send: Send, receive: Receive, *,
                 default_max_tokens: int | None, request_id: str | None = None,
                 tool_call_format: str | None = None,
                 reasoning_parser: str | None = None, unknown_fields: UnknownFields | None = None) -> None:
    """Serve one Responses API request; raises APIError for anything refused before the response."""
    request = protocol.decode(body, rp.ResponsesRequest)
    if unknown_fields is not None:
        unknown_fields.check(body, rp.ResponsesRequest, "/v1/responses")
    rp.refuse_unsupported(request)
    if models.loads_on_demand:  # bad fields are a 400 before the model loads (its defaults only fill unset ones)
        rp.sampling_params(request, default_max_tokens)
    target = await models.resolve(request.model)
    engine, model = target.engine, target.model_id
    params = rp.sampling_params(request, default_max_tokens, engine.sampling_defaults)
    plan = tools.plan(rp.chat_tools(request), tool_call_format or engine.tool_call_format)
    output = chat_output.output_plan(plan, chat_output.reasoning_format(reasoning_parser, engine))
    if plan is not None:
        params = plan.params(params)
    if output is not None:
        params = output.params(params)
    await prepare_params(engine, params, "tools" if plan is not None and plan.constrains_output else "text")
    response = _Response(request, model)
    try:
        messages = tools.template_messages(rp.chat_messages(request), plan, tool_call_format or engine.tool_call_format)
        prompt_ids = await engine.chat_token_ids(messages, tools=plan.template_tools if plan is not None else None,
                                                 **rp.template_kwargs(request))
        stream = engine.generate(prompt_ids, params, request_id=request_id or response.id, lora=target.adapter)
    except APIError:
        raise
    except Exception as error:
        api_error = from_engine_error(error, rp.ENGINE_FIELDS)
        if api_error is None:
            raise
        raise api_error from error
    tool_stream = output.stream(chat_output.prompt_tail(engine, prompt_ids)) if output is not None else None
    respond = _stream_response if request.stream else _full_response
    try:
        await run_until_disconnect(respond(response, tool_stream, stream, send), receive)
    finally:
        await stream.aclose()


async def _full_response(response: _Response, tool_stream: chat_output.ToolCallStream | None, stream: Any,
                         send: Send) -> None:
    texts: list[str] = []
    last: RequestOutput | None = None
    try:
        async for out in stream:
            texts.append(out.text)
            last = out
    except RequestFailedError as error:
        raise APIError(500, str(error), code="request_failed") from error
    if last is None or last.finish_reason == "abort":
        raise APIError(503, ABORTED, code="aborted")
    text = "".join(texts)
    item_status = _status(last.finish_reason)  # a message cut by max_output_tokens is "incomplete" too
    content, calls, reasoning = text, [], ""
    if tool_stream is not None:
        message = tool_stream.message(text)
        content, calls = message["content"] or "", message.get("tool_calls", [])
        reasoning = message.get("reasoning_content", "")
    if reasoning:
        response.output.append(_reasoning_item(_new_id("rs"), reasoning, item_status))
    if content:
        response.output.append(_message_item(_new_id("msg"), content, item_status))
    for call in calls:
        response.output.append(_call_item(_new_id("fc"), call["id"], call["function"]["name"],
                                          call["function"]["arguments"], item_status))
    await send_json(send, 200, response.body(_status(last.finish_reason), last))


class _EventStream:
    """Named SSE events with sequence numbers, and the output items they open and close."""

    def __init__(self, sse: SSEResponse, response: _Response) -> None:
        self.sse = sse
        self.response = response
        self.sequence = 0
        self.message: dict[str, Any] | None = None  # the open message item: id, index, text
        self.reasoning: dict[str, Any] | None = None  # the open reasoning item: id, index, text
        self.calls: dict[int, dict[str, Any]] = {}  # open function calls by the parser's call index

    async def emit(self, kind: str, **fields: Any) -> None:
        await self.sse.named_event(kind, {"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1

    async def reasoning_text(self, delta: str) -> None:
        if self.reasoning is None:
            self.reasoning = {"id": _new_id("rs"), "index": len(self.response.output), "text": ""}
            item = _reasoning_item(self.reasoning["id"], "", "in_progress")
            self.response.output.append(item)
            await self.emit("response.output_item.added", output_index=self.reasoning["index"], item=item)
        self.reasoning["text"] += delta
        await self.emit("response.reasoning_text.delta", item_id=self.reasoning["id"],
                        output_index=self.reasoning["index"], content_index=0, delta=delta)

    async def close_reasoning(self, status: str = "completed") -> None:
        reasoning, self.reasoning = self.reasoning, None
        if reasoning is None:
            return
        await self.emit("response.reasoning_text.done", item_id=reasoning["id"], output_index=reasoning["index"],
                        content_index=0, text=reasoning["text"])
        item = _reasoning_item(reasoning["id"], reasoning["text"], status)
        self.response.output[reasoning["index"]] = item
        await self.emit("response.output_item.done", output_index=reasoning["index"], item=item)

    async def text(self, delta: str) -> None:
        await self.close_reasoning()
        if self.message is None:
            self.message = {"id": _new_id("msg"), "index": len(self.response.output), "text": ""}
            self.response.output.append(_message_item(self.message["id"], "", "in_progress"))
            await self.emit("response.output_item.added", output_index=self.message["index"],
                            item=_message_item(self.message["id"], "", "in_progress"))
            await self.emit("response.content_part.added", item_id=self.message["id"],
                            output_index=self.message["index"], content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})
        self.message["text"] += delta
        await self.emit("response.output_text.delta", item_id=self.message["id"], output_index=self.message["index"],
                        content_index=0, delta=delta, logprobs=[])

    async def close_message(self, status: str = "completed") -> None:
        message, self.message = self.message, None
        if message is None:
            return
        where = {"item_id": message["id"], "output_index": message["index"], "content_index": 0}
        await self.emit("response.output_text.done", **where, text=message["text"], logprobs=[])
        await self.emit("response.content_part.done", **where,
                        part={"type": "output_text", "text": message["text"], "annotations": []})
        item = _message_item(message["id"], message["text"], status)
        self.response.output[message["index"]] = item
        await self.emit("response.output_item.done", output_index=message["index"], item=item)

    async def tool_call(self, call: dict[str, Any]) -> None:
        arguments = call.get("function", {}).get("arguments", "")
        if "id" in call:  # a new call: its name is known
            await self.close_reasoning()
            await self.close_message()
            state = {"id": _new_id("fc"), "index": len(self.response.output), "call_id": call["id"],
                     "name": call["function"]["name"], "arguments": ""}
            self.calls[call["index"]] = state
            item = _call_item(state["id"], state["call_id"], state["name"], "", "in_progress")
            self.response.output.append(item)
            await self.emit("response.output_item.added", output_index=state["index"], item=item)
        state = self.calls[call["index"]]
        if arguments:
            state["arguments"] += arguments
            await self.emit("response.function_call_arguments.delta", item_id=state["id"],
                            output_index=state["index"], delta=arguments)

    async def close_all(self, status: str) -> None:
        """Close the open items with `status` ("completed", or "incomplete" when the output was cut)."""
        await self.close_reasoning(status)
        await self.close_message(status)
        for state in self.calls.values():
            await self.emit("response.function_call_arguments.done", item_id=state["id"], output_index=state["index"],
                            name=state["name"], arguments=state["arguments"])
            item = _call_item(state["id"], state["call_id"], state["name"], state["arguments"], status)
            self.response.output[state["index"]] = item
            await self.emit("response.output_item.done", output_index=state["index"], item=item)
        self.calls = {}


async def _stream_response(response: _Response, tool_stream: chat_output.ToolCallStream | None, stream: Any,
                           send: Send) -> None:
    sse = SSEResponse(send)
    await sse.start()
    events = _EventStream(sse, response)
    await events.emit("response.created", response=response.body("in_progress"))
    await events.emit("response.in_progress", response=response.body("in_progress"))
    last: RequestOutput | None = None
    try:
        async for out in stream:
            last = out
            if out.finish_reason in ("abort", "error"):
                continue  # abort: reported below; error: the stream raises next
            fields = tool_stream.delta(out.text, final=out.finish_reason is not None) if tool_stream is not None \
                else {"content": out.text}
            if fields.get("reasoning_content"):
                await events.reasoning_text(fields["reasoning_content"])
            if fields.get("content"):
                await events.text(fields["content"])
            for call in fields.get("tool_calls", ()):
                await events.tool_call(call)
    except RequestFailedError as error:
        await events.emit("response.failed", response=response.body(
            "failed", last, {"code": "request_failed", "message": str(error)}))
        return await sse.end()
    if last is None or last.finish_reason == "abort":
        await events.emit("response.failed", response=response.body("failed", last, {"code": "aborted",
                                                                                    "message": ABORTED}))
        return await sse.end()
    status = _status(last.finish_reason)
    await events.close_all(status)
    await events.emit(f"response.{status}", response=response.body(status, last))
    await sse.end()
