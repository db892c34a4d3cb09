"""Tool calling for /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, and the answer.

    tool_choice  prompt gets tools   output                                      enforced by
    "none"       no                  plain content
    "auto"       yes                 content and/or calls in the model's format  (parsed; needs a format)
    "required"   yes                 [{"name": ..., "parameters": {...}}, ...]   a JSON-schema grammar
    {"type": "function", "function": {"name": f}}   yes   the arguments of f     f's parameters schema

The model's format comes from its chat template (metrale.text.tool_parsers.detect_format) or the
server's --tool-call-parser. "required" and named calls follow vLLM's convention, so they work with
any model. A response with calls has `message.tool_calls` (streamed as OpenAI does: per call a first
delta with index, id, type and name, then fragments of the arguments' JSON text) and finish_reason
"tool_calls" ("stop" for a named function, as OpenAI). Assistant turns with `tool_calls` and `tool` turns
reach the template with their arguments decoded into objects, as Hugging Face templates expect.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from metrale.sampling_params import SamplingParams
from metrale.server.errors import bad_request
from metrale.structured_outputs import StructuredOutputs
from metrale.text.tool_calls import ParserDelta, ToolCallParser, collect
from metrale.text.tool_parsers import FORMATS, NamedCallParser, make_parser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_ARGUMENTS_DEPTH = 100  # nesting of a history turn's tool-call arguments (the template serializes them recursively)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request uses its tools."""

    choice: str  # "none" | "auto" | "required" | "named"
    tools: tuple[dict[str, Any], ...]  # OpenAI shape, for the template (empty for "none")
    fmt: str | None = None  # the parser format of "auto"
    named: str | None = None  # the function of "named"
    parallel: bool = True

    @property
    def constrains_output(self) -> bool:
        """"required" and a named function: the output must be a valid call (a grammar enforces it)."""
        return self.choice in ("required", "named")

    @property
    def parses_calls(self) -> bool:
        """Whether the output is parsed for tool calls (everything but "none")."""
        return self.choice != "none"

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return list(self.tools) if self.choice != "none" and self.tools else None

    def params(self, params: SamplingParams) -> SamplingParams:
        """The request's params with the constraint "required" / named need (a 400 if one is already set)."""
        spec = self._constraint()
        if spec is None:
            if self.choice == "auto" and self.fmt in ("mistral", "llama3_json") and params.skip_special_tokens:
                return msgspec.structs.replace(params, skip_special_tokens=False)  # their markers are special
            return params
        if params.structured_outputs is not None:
            raise bad_request(f"tool_choice {self.choice!r} cannot be combined with response_format, "
                              f"structured_outputs or guided_* fields", "tool_choice")
        return msgspec.structs.replace(params, structured_outputs=spec)

    def stream(self) -> "ToolCallStream | None":
        """The per-response parser state; None when the output is plain content."""
        if not self.parses_calls:
            return None
        if self.choice == "named":
            return ToolCallStream(NamedCallParser(self.named), forced=True)  # type: ignore[arg-type]
        fmt = "json_list" if self.choice == "required" else self.fmt
        return ToolCallStream(make_parser(fmt))  # type: ignore[arg-type]

    def _constraint(self) -> StructuredOutputs | None:
        if self.choice == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.named)
            return StructuredOutputs(json=tool["function"].get("parameters") or EMPTY_PARAMETERS)
        if self.choice == "required":
            return StructuredOutputs(json=required_schema(self.tools, self.parallel))
        return None


@dataclass(slots=True)
class ToolCallStream:
    """One response's tool-call parsing: text deltas in, OpenAI `delta` fields out."""

    parser: ToolCallParser
    forced: bool = False  # a named function: finish_reason stays "stop"
    ids: dict[int, str] = field(default_factory=dict)

    def feed(self, text: str) -> dict[str, Any]:
        """The chat `delta` fields for a piece of output text ({} when nothing is certain yet)."""
        return self._fields(self.parser.feed(text))

    def finish(self) -> dict[str, Any]:
        """The delta fields of what the parser held back until the end."""
        return self._fields(self.parser.finish())

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """`feed`, and with `final` also `finish`, as one chat `delta`."""
        fields = self.feed(text)
        if final:
            for key, value in self.finish().items():
                fields[key] = fields.get(key, type(value)()) + value  # content: str, tool_calls: list
        return fields

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.ids and not self.forced:
            return "tool_calls"
        return reason

    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed message: the same parser over the whole text."""
        deltas = [self.parser.feed(text), self.parser.finish()]
        for delta in deltas:
            self._fields(delta)  # the call ids, in order
        parsed = collect(deltas)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["content"] = parsed.content if parsed.content.strip() else None
            message["tool_calls"] = [{"id": self.ids[i], "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}
                                     for i, call in enumerate(parsed.tool_calls)]
        return message

    def _fields(self, delta: ParserDelta) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if delta.content:
            fields["content"] = delta.content
        calls = []
        for call in delta.tool_calls:
            if call.name is not None:
                self.ids[call.index] = f"call_{uuid.uuid4().hex[:24]}"
                calls.append({"index": call.index, "id": self.ids[call.index], "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            else:
                calls.append({"index": call.index, "function": {"arguments": call.arguments}})
        if calls:
            fields["tool_calls"] = calls
        return fields


def plan(request: Any, model_format: str | None) -> ToolPlan | None:
    """Validate tools / tool_choice / parallel_tool_calls; None when the request has no tools."""
    tools = _tools(request.tools)
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    parallel = True if request.parallel_tool_calls is None else request.parallel_tool_calls
    names = [t["function"]["name"] for t in tools]
    if choice is None or choice in ("none", "auto", "required"):
        choice = choice or "auto"
        if choice == "auto" and model_format is None:
            raise bad_request("tool_choice \"auto\" needs to know how the model writes tool calls, and its chat "
                              "template shows none; start the server with --tool-call-parser "
                              f"({', '.join(f for f in FORMATS if f != 'json_list')}), or use tool_choice "
                              "\"required\" or a named function", "tool_choice")
        return ToolPlan(choice, tools, fmt=model_format, parallel=parallel)
    named = _named_choice(choice)
    if named not in names:
        raise bad_request(f"tool_choice names function {named!r}, which is not in tools ({', '.join(names)})",
                          "tool_choice")
    return ToolPlan("named", tools, named=named, parallel=parallel)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for the chat template: assistant tool-call arguments decoded from their JSON text into
    objects (as Hugging Face templates expect them); a 400 on malformed tool calls."""
    out = []
    for index, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is not None:
            if message.get("role") != "assistant" or not isinstance(calls, list):
                raise bad_request(f"messages[{index}].tool_calls must be a list on an assistant message",
                                  "messages")
            message = {**message, "tool_calls": [_decoded_call(index, j, call) for j, call in enumerate(calls)]}
        if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), (str, type(None))):
            raise bad_request(f"messages[{index}].tool_call_id must be a string", "messages")
        out.append(message)
    return out


def required_schema(tools: tuple[dict[str, Any], ...], parallel: bool) -> dict[str, Any]:
    """The JSON schema of tool_choice "required": a non-empty list of {"name", "parameters"} calls.
    Each tool's $defs move to the top, where its "#/$defs/..." references look for them."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        function = tool["function"]
        parameters = dict(function.get("parameters") or EMPTY_PARAMETERS)
        for key in ("$defs", "definitions"):
            for name, schema in (parameters.pop(key, None) or {}).items():
                if defs.get(name, schema) != schema:
                    raise bad_request(f"tools define $defs {name!r} twice, differently", "tools")
                defs[name] = schema
        variants.append({"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                                          "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _tools(tools: Any) -> tuple[dict[str, Any], ...]:
    if not tools:
        return ()
    checked = []
    seen = set()
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                              "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{index}].function.name must be a non-empty string", "tools")
        if name in seen:
            raise bad_request(f"tools[{index}]: function {name!r} is defined twice", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"tools[{index}].function.parameters must be a JSON schema object", "tools")
        seen.add(name)
        checked.append({"type": "function", "function": function})
    return tuple(checked)


def _named_choice(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise bad_request("tool_choice must be \"none\", \"auto\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return name


def _decoded_call(index: int, position: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"messages[{index}].tool_calls[{position}] must have function.name", "messages")
    arguments = function.get("arguments")
    where = f"messages[{index}].tool_calls[{position}].function.arguments"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise bad_request(f"{where} is not JSON", "messages") from None
        except RecursionError:  # "[[[[..." 100k deep inside the string
            raise bad_request(f"{where} is nested more than {MAX_ARGUMENTS_DEPTH} deep", "messages") from None
    if _deeper_than(arguments, MAX_ARGUMENTS_DEPTH):  # the template's tojson would recurse on it
        raise bad_request(f"{where} is nested more than {MAX_ARGUMENTS_DEPTH} deep", "messages")
    return {**call, "function": {**function, "arguments": arguments if arguments is not None else {}}}


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests lists/objects more than `limit` deep (iterative: any depth is safe)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False
