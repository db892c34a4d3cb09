"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat machinery.

    body -> MessagesRequest (anthropic_protocol.py) -> ChatCompletionRequest (system first, tool_use blocks as
         assistant tool_calls, tool_result blocks as tool turns) -> the same validation, chat template, tool
         plan and engine stream as /v1/chat/completions -> content blocks: text and tool_use

Reasoning the chat template shows (a <think> block, gpt-oss's analysis channel; --reasoning-parser overrides, as on
the OpenAI routes) comes first as a `thinking` block. A whole response is one `message` object. A streamed one is
Anthropic's named SSE events:

    message_start (the message with empty content and the input usage)
    per block:  content_block_start  content_block_delta (thinking_delta | text_delta | input_json_delta) ...
                content_block_stop
    message_delta (stop_reason, stop_sequence, output usage)   message_stop
    a failure after the start: an `error` event instead of message_delta / message_stop

stop_reason: "end_turn" (the model's end of turn), "stop_sequence" (one of stop_sequences, named in
stop_sequence), "max_tokens", or "tool_use" when the answer holds tool calls. Errors are Anthropic's
`{"type": "error", "error": {"type", "message"}}` with the status the OpenAI routes would give.
"""

from __future__ import annotations

import uuid
from typing import Any

from metrale.errors import RequestFailedError
from metrale.outputs import RequestOutput
from metrale.server import anthropic_protocol as ap
from metrale.server import chat_output, completions, protocol
from metrale.server.asgi import Receive, Send, SSEResponse, run_until_disconnect, send_json
from metrale.server.errors import APIError
from metrale.server.resolve import ModelResolver

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
PATHS = (MESSAGES_PATH, COUNT_TOKENS_PATH)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def error_body(error: APIError) -> dict[str, Any]:
    """Anthropic's error object for an APIError."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


async def handle(models: ModelResolver, path: str, body: bytes, send: Send, receive: Receive, *,
                 request_id: str | None = None, tool_call_format: str | None = None,
                 reasoning_parser: str | None = None) -> None:
    """Serve one Messages API request; anything refused before the response is an Anthropic error body.
    `reasoning_parser`: the server's --reasoning-parser (None: what the chat template shows)."""
    try:
        if path == COUNT_TOKENS_PATH:
            return await _count_tokens(models, body, send)
        request = protocol.decode(body, ap.MessagesRequest)
        chat = ap.to_chat_request(request)
        completions.check_before_loading(models, chat, None)
        target = await models.resolve(chat.model)
        call, stream = await completions.open_stream(target, chat, default_max_tokens=None, request_id=request_id,
                                                     tool_call_format=tool_call_format,
                                                     reasoning_parser=reasoning_parser or "auto")
    except APIError as error:
        if error.reject_reason is not None:
            models.record_rejected(error.reject_reason)
        return await send_json(send, error.status, error_body(error), error.headers)
    message = _Message(call, request)
    respond = _stream_response if request.stream else _full_response
    try:
        await run_until_disconnect(respond(message, stream, send), receive)
    finally:
        await stream.aclose()  # no-op once finished; aborts the request on disconnect or error


async def _count_tokens(models: ModelResolver, body: bytes, send: Send) -> None:
    request = protocol.decode(body, ap.CountTokensRequest)
    chat = ap.to_chat_request(request)
    target = await models.resolve(chat.model)
    prompt_ids = await completions.prompt_token_ids(target.engine, chat)
    await send_json(send, 200, {"input_tokens": len(prompt_ids)})


class _Message:
    """The response message of one request: its blocks as the tool-call parser makes them certain."""

    def __init__(self, call: Any, request: ap.MessagesRequest) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.call = call
        self.model = call.model
        self.stop_sequences = tuple(request.stop_sequences or ())
        self.parser = call.plan.stream(call.prompt_tail) if call.plan is not None else None
        self.blocks: list[dict[str, Any]] = []  # finished and open blocks, in order
        self.open: dict[str, Any] | None = None  # the block deltas go to
        self.last: RequestOutput | None = None

    def start_body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(self.call.prompt_token_ids), "output_tokens": 0}}

    def body(self) -> dict[str, Any]:
        """The whole message (non-streamed)."""
        return {**self.start_body(), "content": [_finished(b) for b in self.blocks], **self.stop(),
                "usage": self.usage()}

    def stop(self) -> dict[str, Any]:
        """stop_reason and stop_sequence, once the last delta arrived."""
        reason = self.last.finish_reason if self.last is not None else None
        if any(b["type"] == "tool_use" for b in self.blocks):
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        matched = self.last.stop_reason if self.last is not None else None
        if isinstance(matched, str) and matched in self.stop_sequences:
            return {"stop_reason": "stop_sequence", "stop_sequence": matched}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def usage(self) -> dict[str, Any]:
        last = self.last
        return {"input_tokens": last.num_prompt_tokens - last.num_cached_tokens,
                "cache_read_input_tokens": last.num_cached_tokens, "cache_creation_input_tokens": 0,
                "output_tokens": last.num_output_tokens}

    def feed(self, out: RequestOutput) -> list[tuple[str, dict[str, Any]]]:
        """Take one delta; the SSE events (name, data) it makes certain."""
        self.last = out
        final = out.finish_reason is not None
        if self.parser is None:
            return self._text(out.text) + (self._close() if final else [])
        fields = self.parser.delta(out.text, final=final)
        events = self._thinking(fields.get("reasoning_content", "")) + self._text(fields.get("content", ""))
        for call in fields.get("tool_calls", ()):
            events += self._tool_call(call)
        return events + (self._close() if final else [])

    def _thinking(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not text:
            return []
        events = []
        if self.open is None or self.open["type"] != "thinking":
            events = self._close() + self._open({"type": "thinking", "thinking": "", "signature": ""})
        self.open["thinking"] += text
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def _text(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not text:
            return []
        events = []
        if self.open is None or self.open["type"] != "text":
            events = self._close() + self._open({"type": "text", "text": ""})
        self.open["text"] += text
        return events + [self._delta({"type": "text_delta", "text": text})]

    def _tool_call(self, call: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = []
        function = call["function"]
        if "name" in function:  # a new call: its first fragment
            events = self._close() + self._open({"type": "tool_use", "id": call["id"], "name": function["name"],
                                                 "input": {}, "arguments": ""})
        if function.get("arguments"):
            self.open["arguments"] += function["arguments"]
            events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return events

    def _open(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        self.blocks.append(block)
        self.open = block
        return [("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                         "content_block": _started(block)})]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]


def _started(block: dict[str, Any]) -> dict[str, Any]:
    """A block as content_block_start shows it: empty text, empty input."""
    if block["type"] == "text":
        return {"type": "text", "text": ""}
    if block["type"] == "thinking":  # no signature: the reasoning is the model's own text, nothing to verify
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}


def _finished(block: dict[str, Any]) -> dict[str, Any]:
    if block["type"] == "text":
        return {"type": "text", "text": block["text"]}
    if block["type"] == "thinking":
        return {"type": "thinking", "thinking": block["thinking"], "signature": ""}
    return {"type": "tool_use", "id": block["id"], "name": block["name"], "input": chat_output.arguments_object(block["arguments"])}


async def _full_response(message: _Message, stream: Any, send: Send) -> None:
    await completions.read_whole(stream, message.feed)
    await send_json(send, 200, message.body())


async def _stream_response(message: _Message, stream: Any, send: Send) -> None:
    sse = SSEResponse(send)
    await sse.start()
    await sse.named_event("message_start", {"type": "message_start", "message": message.start_body()})
    try:
        async for out in stream:
            if out.finish_reason in ("abort", "error"):
                message.last = out
                continue  # abort: reported below; error: the stream raises next
            for name, data in message.feed(out):
                await sse.named_event(name, data)
    except RequestFailedError as error:
        return await _end_with_error(sse, APIError(500, str(error), code="request_failed"))
    if message.last is None or message.last.finish_reason == "abort":
        return await _end_with_error(sse, APIError(503, completions.ABORTED, code="aborted"))
    await sse.named_event("message_delta", {"type": "message_delta", "delta": message.stop(),
                                      "usage": {"output_tokens": message.last.num_output_tokens}})
    await sse.named_event("message_stop", {"type": "message_stop"})
    await sse.end()


async def _end_with_error(sse: SSEResponse, error: APIError) -> None:
    await sse.named_event("error", error_body(error))
    await sse.end()
