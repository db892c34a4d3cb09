"""Anthropic Messages API request bodies (msgspec Structs) and their translation into a chat completion request.

    MessagesRequest                          ChatCompletionRequest
    system: str | [text blocks]         ->   a first {"role": "system"} message
    user: str | [text, tool_result]     ->   one {"role": "tool", "tool_call_id"} turn per tool_result, then the text
    assistant: [text, tool_use]         ->   {"role": "assistant", "content", "tool_calls": [{id, function}]}
    tools: [{name, description, input_schema}]        -> OpenAI function tools
    tool_choice: auto | any | tool(name) | none       -> "auto" | "required" | named | "none"
    stop_sequences, temperature, top_p, top_k, max_tokens -> the same sampling fields (the sampling knobs are
                                                         gone from Anthropic's current clients; older ones send them)
    thinking: {"type": "enabled" | "adaptive" | "between_tools" | "disabled"} -> chat_template_kwargs.enable_thinking
    output_config: format (a JSON schema)             -> response_format json_schema (grammar-enforced)
                   effort                             -> chat_template_kwargs.reasoning_effort

Images, documents and Anthropic's server tools (web search, code execution, ...) are refused with a 400 naming
them; thinking blocks of earlier assistant turns are dropped (templates re-render no reasoning).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from metrale.server import protocol
from metrale.server.errors import bad_request

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class TextBlock(msgspec.Struct, kw_only=True, tag="text"):
    text: str
    cache_control: Any = None  # accepted: the prefix cache is automatic
    citations: Any = None


class ToolUseBlock(msgspec.Struct, kw_only=True, tag="tool_use"):
    id: str
    name: str
    input: Any = None
    cache_control: Any = None


class ToolResultBlock(msgspec.Struct, kw_only=True, tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: Any = None


class ThinkingBlock(msgspec.Struct, kw_only=True, tag="thinking"):
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, kw_only=True, tag="redacted_thinking"):
    data: str = ""


class ImageBlock(msgspec.Struct, kw_only=True, tag="image"):
    source: Any = None


class DocumentBlock(msgspec.Struct, kw_only=True, tag="document"):
    source: Any = None


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | ImageBlock | DocumentBlock


class Message(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(msgspec.Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or absent; Anthropic's server tools ("web_search_20250305", ...) are refused
    cache_control: Any = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True):
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: Int64 | None = None
    display: Any = None


class JsonOutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """POST /v1/messages/count_tokens."""

    model: str
    messages: Annotated[list[Message], msgspec.Meta(max_length=protocol.MAX_MESSAGES)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool], msgspec.Meta(max_length=protocol.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """POST /v1/messages."""

    max_tokens: Int64
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    output_config: OutputConfig | None = None
    # accepted, changing nothing here: ids for the caller's records, one tier, one region, automatic caching
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    cache_control: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    diagnostics: Any = None
    # refused when set: nothing here runs them
    container: Any = None
    mcp_servers: Any = None


_REFUSED = ("container", "mcp_servers")


def to_chat_request(request: CountTokensRequest) -> protocol.ChatCompletionRequest:
    """The chat completion request that asks the engine for the same thing; a 400 naming the field for
    anything metrale cannot do."""
    for name in _REFUSED:
        if getattr(request, name, None) is not None:
            raise bad_request(f"{name} is not supported by this server", name)
    body: dict[str, Any] = {"model": request.model, "messages": _messages(request)}
    if request.tools:
        body["tools"] = [_tool(i, tool) for i, tool in enumerate(request.tools)]
        if request.tool_choice is not None:
            body.update(_tool_choice(request.tool_choice))
    elif request.tool_choice is not None and request.tool_choice.type not in ("auto", "none"):
        raise bad_request(f"tool_choice {request.tool_choice.type!r} needs tools", "tool_choice")
    template_kwargs: dict[str, Any] = {}
    if request.thinking is not None:
        template_kwargs["enable_thinking"] = request.thinking.type != "disabled"
    if isinstance(request, MessagesRequest) and request.output_config is not None:
        if request.output_config.effort is not None:  # templates with effort levels (gpt-oss) read it
            template_kwargs["reasoning_effort"] = request.output_config.effort
        if request.output_config.format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": request.output_config.format.schema}}
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    if isinstance(request, MessagesRequest):
        body["max_tokens"] = request.max_tokens
        body["stream"] = request.stream
        for name in ("temperature", "top_p", "top_k"):
            if getattr(request, name) is not None:
                body[name] = getattr(request, name)
        if request.stop_sequences:
            body["stop"] = request.stop_sequences
    return msgspec.convert(body, protocol.ChatCompletionRequest)


def _messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else "\n".join(b.text for b in request.system)
        messages.append({"role": "system", "content": system})
    if not request.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    for index, message in enumerate(request.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            messages.extend(_user_turns(index, message.content))
        else:
            messages.append(_assistant_turn(index, message.content))
    return messages


def _user_turns(index: int, blocks: list[Block]) -> list[dict[str, Any]]:
    """tool_result blocks become tool turns (they answer the previous assistant turn's calls), then the text."""
    turns: list[dict[str, Any]] = []
    texts = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)})
        elif isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
        else:
            raise _unsupported(index, block)
    if texts:
        turns.append({"role": "user", "content": texts})
    return turns


def _assistant_turn(index: int, blocks: list[Block]) -> dict[str, Any]:
    text = []
    calls = []
    for block in blocks:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input or {})}})
        elif not isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            raise _unsupported(index, block)
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _result_text(block: ToolResultBlock) -> str:
    content = block.content
    text = content if isinstance(content, str) else "".join(part.text for part in content or ())
    return f"Error: {text}" if block.is_error else text


def _unsupported(index: int, block: Any) -> Exception:
    kind = type(block).__struct_config__.tag
    return bad_request(f"messages[{index}]: {kind} blocks are not supported by this server (text-only models)",
                       "messages")


def _tool(index: int, tool: Tool) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise bad_request(f"tools[{index}]: Anthropic server tool {tool.type!r} is not available here; "
                          "declare client tools with name, description and input_schema", "tools")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type \"tool\" needs a name", "tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields
