"""Tool calling for /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, and the answer.

    tool_choice  prompt gets tools   output                                      enforced by
    "none"       no                  plain content
    "auto"       yes                 content and/or calls in the model's format  (parsed)
                                     or, when its template shows none, the generic {"tool_call": ...} |
                                     {"response": ...} answer (metrale.text.generic_tools)   a JSON-schema grammar
    "required"   yes                 [{"name": ..., "parameters": {...}}, ...]   a JSON-schema grammar
    {"type": "function", "function": {"name": f}}   yes   the arguments of f     f's parameters schema

`tools` without `tool_choice` is "auto". The model's format comes from its chat template
(metrale.text.output_parsing.detect_format) or the server's --tool-call-parser. "required" and named
calls follow vLLM's convention, so they work with any model. Reasoning (`<think>` ...) is split into
`reasoning_content` by the parser the template shows or --reasoning-parser names, in front of the
tool-call parser (metrale.server.chat_output, which also shapes the answer); not when a grammar holds
the output to a call. Assistant turns with `tool_calls` and `tool` turns
reach the template with their arguments decoded into objects, as Hugging Face templates expect.
"""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass
from typing import Any

import msgspec

from metrale.sampling_params import SamplingParams
from metrale.server.errors import bad_request
from metrale.structured_outputs import StructuredOutputs
from metrale.text import generic_tools
from metrale.text.output_parsing import make_parser
from metrale.text.tool_parsers import NamedCallParser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_ARGUMENTS_DEPTH = 100  # nesting of a history turn's tool-call arguments (the template serializes them recursively)
_ALNUM = string.ascii_letters + string.digits


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
        """"required", a named function and the generic format: a grammar holds the output to its shape."""
        return self.choice in ("required", "named") or (self.choice == "auto" and self.fmt == "generic")

    @property
    def parses_calls(self) -> bool:
        """Whether the output is parsed for tool calls (everything but "none")."""
        return self.choice != "none"

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return list(self.tools) if self.choice != "none" and self.tools else None

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The generic format tells the model the tools and the answer's shape in the system message."""
        if self.choice == "auto" and self.fmt == "generic":
            return generic_tools.with_instructions(messages, generic_tools.instructions(self.tools, self.parallel))
        return messages

    def params(self, params: SamplingParams) -> SamplingParams:
        """The request's params with the constraint "required" / named / generic need (a 400 if one is
        already set)."""
        requested = params.structured_outputs
        spec = self._constraint(_response_schema(requested) if self.fmt == "generic" else None)
        if spec is None:
            return params
        if requested is not None and not (self.choice == "auto" and self.fmt == "generic"
                                          and requested.kind in ("json", "json_object")):
            raise bad_request(f"tool_choice {self.choice!r} cannot be combined with response_format, "
                              f"structured_outputs or guided_* fields", "tool_choice")
        return msgspec.structs.replace(params, structured_outputs=spec)

    def parser(self) -> Any:
        """A fresh tool-call parser for one output (a NamedCallParser for a named function)."""
        if self.choice == "named":
            return NamedCallParser(self.named)  # type: ignore[arg-type]
        return make_parser("json_list" if self.choice == "required" else self.fmt, self.tools)  # type: ignore[arg-type]

    def _constraint(self, response: dict[str, Any] | None = None) -> StructuredOutputs | None:
        try:
            if self.choice == "named":
                tool = next(t for t in self.tools if t["function"]["name"] == self.named)
                return StructuredOutputs(json=tool["function"].get("parameters") or EMPTY_PARAMETERS)
            if self.choice == "required":
                return StructuredOutputs(json=required_schema(self.tools, self.parallel))
        except ValueError as error:  # past StructuredOutputs' bounds (size, "$ref" count)
            message = str(error).removeprefix("structured_outputs.json").removeprefix(":").strip()
            raise bad_request(f"tools: {message}", "tools") from None
        if self.constrains_output:  # generic
            try:
                return StructuredOutputs(json=generic_tools.schema(self.tools, self.parallel, response))
            except ValueError as error:
                raise bad_request(str(error), "tools") from error
        return None


def _response_schema(requested: StructuredOutputs | None) -> dict[str, Any] | None:
    """The generic format's "response" as response_format asks for it (a JSON schema or any object)."""
    if requested is None:
        return None
    if requested.kind == "json_object":
        return {"type": "object"}
    return json.loads(requested.json) if requested.kind == "json" else None


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
        choice = choice or "auto"  # OpenAI's default when tools are given
        return ToolPlan(choice, tools, fmt=model_format or "generic", parallel=parallel)
    named = _named_choice(choice)
    if named not in names:
        raise bad_request(f"tool_choice names function {named!r}, which is not in tools ({', '.join(names)})",
                          "tool_choice")
    return ToolPlan("named", tools, named=named, parallel=parallel)


def template_messages(messages: list[dict[str, Any]], plan: ToolPlan | None = None,
                      model_format: str | None = None) -> list[dict[str, Any]]:
    """Messages for the chat template: assistant tool-call arguments decoded from their JSON text into
    objects (as Hugging Face templates expect them), the generic format's instructions added, and for
    Mistral's templates call ids made the 9 letters and digits they insist on; a 400 on malformed tool calls."""
    out = []
    short_ids = model_format == "mistral"
    for index, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is not None:
            if message.get("role") != "assistant" or not isinstance(calls, list):
                raise bad_request(f"messages[{index}].tool_calls must be a list on an assistant message",
                                  "messages")
            calls = [_decoded_call(index, j, call) for j, call in enumerate(calls)]
            if short_ids:
                calls = [{**call, "id": mistral_id(call.get("id"))} for call in calls]
            message = {**message, "tool_calls": calls}
        if message.get("role") == "tool":
            if not isinstance(message.get("tool_call_id"), (str, type(None))):
                raise bad_request(f"messages[{index}].tool_call_id must be a string", "messages")
            if short_ids:
                message = {**message, "tool_call_id": mistral_id(message.get("tool_call_id"))}
        out.append(message)
    return plan.messages(out) if plan is not None else out


def mistral_id(call_id: Any) -> Any:
    """A call id as Mistral's templates want it (9 letters and digits): kept when it is, else a stable hash."""
    if not isinstance(call_id, str) or (len(call_id) == 9 and call_id.isalnum() and call_id.isascii()):
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    return "".join(_ALNUM[byte % len(_ALNUM)] for byte in digest[:9])


def required_schema(tools: tuple[dict[str, Any], ...], parallel: bool) -> dict[str, Any]:
    """The JSON schema of tool_choice "required": a non-empty list of {"name", "parameters"} calls.
    Each tool's $defs move to the top, where its "#/$defs/..." references look for them."""
    try:
        variants, defs = generic_tools.call_variants(tools, "parameters")
    except ValueError as error:
        raise bad_request(str(error), "tools") from error
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
