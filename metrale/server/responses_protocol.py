"""POST /v1/responses request bodies: the OpenAI Responses API mapped onto the chat machinery.

    input: "text"                         -> [user message]
    input: [ {role, content}, ...]        -> messages (developer as the template renders it; content a string or
                                              input_text / output_text parts)
           {type: function_call, call_id, name, arguments}  -> an assistant turn with tool_calls
           {type: function_call_output, call_id, output}    -> a tool turn
    instructions                          -> a system message first
    tools: [{type: function, name, description, parameters}] -> chat tools (metrale.server.tools)
    tool_choice: "auto" | "none" | "required" | {type: function, name}
    text.format: {type: text | json_object | json_schema (schema)} -> structured outputs

Fields metrale cannot honour (stored responses, previous_response_id, conversation,
background mode, include, truncation "auto", built-in tools) are refused with a 400 naming them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from metrale.sampling_params import SamplingParams
from metrale.server import protocol
from metrale.server.errors import bad_request, request_field
from metrale.server.protocol import Int64
from metrale.structured_outputs import StructuredOutputs

# The engine's parameter names (an error's `field`) as the Responses API calls them.
ENGINE_FIELDS = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens", "structured_outputs": "text"}
_ROLES = {"user": "user", "system": "system", "developer": "developer", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses."""

    model: str | None = None
    input: str | Annotated[list[Any], msgspec.Meta(max_length=protocol.MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: protocol.Tools | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: Int64 | None = None
    max_tool_calls: Int64 | None = None
    prompt: Any = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ChatToolsView:
    """The request's tools in chat form, for metrale.server.tools.plan."""

    tools: list[dict[str, Any]] | None
    tool_choice: Any
    parallel_tool_calls: bool | None


def refuse_unsupported(request: ResponsesRequest) -> None:
    """A 400 naming the first field metrale cannot honour."""
    if request.store:
        raise bad_request("store is not supported: responses are not kept (send store: false)", "store")
    for name in ("previous_response_id", "conversation", "prompt"):
        if getattr(request, name) is not None:
            raise bad_request(f"{name} is not supported: responses are not kept, send the whole input", name)
    effort = (request.reasoning or {}).get("effort")
    if effort is not None and effort not in protocol.REASONING_EFFORTS:
        raise bad_request(f"reasoning.effort must be one of {', '.join(protocol.REASONING_EFFORTS)}; got {effort!r}",
                          "reasoning")
    if request.background:
        raise bad_request("background mode is not supported", "background")
    if request.include:
        raise bad_request(f"include is not supported (got {request.include})", "include")
    if request.truncation not in (None, "disabled"):
        raise bad_request("truncation \"auto\" is not supported; a too long input is a 400", "truncation")
    if request.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses; use /v1/chat/completions", "top_logprobs")
    if request.max_tool_calls is not None:
        raise bad_request("max_tool_calls is not supported", "max_tool_calls")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def template_kwargs(request: ResponsesRequest) -> dict[str, Any]:
    """reasoning.effort as the chat template's reasoning_effort (and "none" as enable_thinking=False)."""
    effort = (request.reasoning or {}).get("effort")
    return protocol.template_kwargs(_Effort(effort))


@dataclass(frozen=True, slots=True)
class _Effort:
    reasoning_effort: str | None
    chat_template_kwargs: None = None


def sampling_params(request: ResponsesRequest, default_max_tokens: int | None,
                    model_defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The request's params; `model_defaults` (the model's generation_config.json) fill what it leaves unset."""
    kwargs: dict[str, Any] = {"max_tokens": request.max_output_tokens if request.max_output_tokens is not None
                              else default_max_tokens}
    kwargs.update(model_defaults or {})
    for name in ("temperature", "top_p"):
        value = getattr(request, name)
        if value is not None:
            if not math.isfinite(value):
                raise bad_request(f"{name} must be a finite number, got {value}", name)
            kwargs[name] = value
    structured = _text_format(request.text)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as error:
        message = str(error).replace("max_tokens", "max_output_tokens")
        raise bad_request(message, request_field(error, ENGINE_FIELDS)) from error


def _text_format(text: dict[str, Any] | None) -> StructuredOutputs | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return StructuredOutputs(json=fmt["schema"])
    raise bad_request("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                      "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}", "text")


def chat_tools(request: ResponsesRequest) -> ChatToolsView:
    """The Responses tools and tool_choice in chat form (flat function tools -> {"function": {...}})."""
    tools = None
    if request.tools:
        tools = []
        for index, tool in enumerate(request.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
                raise bad_request(f"tools[{index}]: only function tools are supported, got {kind!r}", "tools")
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            tools.append({"type": "function", "function": function})
    choice = request.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be \"none\", \"auto\", \"required\" or "
                              "{\"type\": \"function\", \"name\": ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return ChatToolsView(tools, choice, request.parallel_tool_calls)


def chat_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation for the chat template: instructions first, then the input items."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        if not request.input:
            raise bad_request("input is empty", "input")
        return messages + [{"role": "user", "content": request.input}]
    if not request.input:
        raise bad_request("input must be a non-empty string or list of items", "input")
    reasoning = ""  # a reasoning item given back: the next assistant turn's reasoning_content
    for index, item in enumerate(request.input):
        if isinstance(item, dict) and item.get("type") == "reasoning":
            reasoning += _reasoning_text(index, item)
            continue
        message = _message(index, item)
        if reasoning and message["role"] == "assistant":
            message["reasoning_content"], reasoning = reasoning, ""
        messages.append(message)
    return messages


def _reasoning_text(index: int, item: dict[str, Any]) -> str:
    """The text of a reasoning item (its reasoning_text content, else its summary)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise bad_request(f"input[{index}]: a reasoning item's content and summary are lists of text parts", "input")
    return "".join(p["text"] for p in parts)


def _message(index: int, item: Any) -> dict[str, Any]:
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object", "input")
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise bad_request(f"{where}.output must be a string", "input")
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
    if kind != "message":
        raise bad_request(f"{where}: items of type {kind!r} are not supported", "input")
    role = _ROLES.get(item.get("role"))
    if role is None:
        raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {item.get('role')!r}", "input")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{j}] must be an input_text part (only text is supported)", "input")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or a list of text parts", "input")
    return {"role": role, "content": content}
