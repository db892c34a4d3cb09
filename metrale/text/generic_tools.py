"""The generic tool-call format, for a model whose chat template knows none (llama.cpp's "Generic" handler).

The model answers with one JSON object, held to this shape by a grammar (structured outputs):

    {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}       one call
    {"tool_calls": [{"name": ..., "arguments": {...}}, ...]}                       parallel calls
    {"response": "text for the user"}                                              no call
    {"response": {...}}                                   no call, with a response_format schema (its JSON is the content)

and the prompt says so in a system message that lists the tools (`instructions`). `GenericParser`
streams the object: the response's text as content (its JSON escapes decoded), the calls as deltas.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from metrale.text.json_scan import ObjectScanner, ScanError, ValueStart, ValueText
from metrale.text.tool_calls import CallScanner, ParserDelta, ToolCallParser, merged
from metrale.text.tool_parsers import JsonListParser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def call_variants(tools: Sequence[Mapping[str, Any]], arguments_key: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One JSON-schema variant per tool, {"name": <its name>, arguments_key: <its parameters>}, and the tools' $defs
    moved to the top, where their "#/$defs/..." references look for them (ValueError when two differ)."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        function = tool["function"]
        parameters = dict(function.get("parameters") or EMPTY_PARAMETERS)
        for key in ("$defs", "definitions"):
            for name, sub in (parameters.pop(key, None) or {}).items():
                if defs.get(name, sub) != sub:
                    raise ValueError(f"tools define $defs {name!r} twice, differently")
                defs[name] = sub
        variants.append({"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                                          arguments_key: parameters},
                         "required": ["name", arguments_key], "additionalProperties": False})
    return variants, defs


def schema(tools: Sequence[Mapping[str, Any]], parallel: bool,
           response: Mapping[str, Any] | bool | None = None) -> dict[str, Any]:
    """The JSON schema of a generic answer: a call (or, with `parallel`, a list of calls) or a response
    (a string, or what `response`, the request's response_format schema, describes)."""
    variants, defs = call_variants(tools, "arguments")
    call = {"anyOf": variants} if len(variants) > 1 else variants[0]
    calls = ({"type": "object", "properties": {"tool_calls": {"type": "array", "minItems": 1, "items": call}},
              "required": ["tool_calls"], "additionalProperties": False} if parallel else
             {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
              "additionalProperties": False})
    answer = {"type": "object", "properties": {"response": response if response is not None else {"type": "string"}},
              "required": ["response"], "additionalProperties": False}
    root: dict[str, Any] = {"anyOf": [calls, answer]}
    if defs:
        root["$defs"] = defs
    return root


def instructions(tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    """The system text that tells the model the tools and the answer's shape."""
    listed = json.dumps([tool["function"] for tool in tools], ensure_ascii=False, indent=2)
    example = ('{"tool_calls": [{"name": "<tool name>", "arguments": {...}}]}' if parallel else
               '{"tool_call": {"name": "<tool name>", "arguments": {...}}}')
    return ("You can call these tools:\n" + listed + "\n\nRespond in JSON format, either with a tool call, "
            f"as {example}, or with a response to the user, as {{\"response\": \"...\"}}.")


def with_instructions(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`messages` with `text` first in the system message (a new one when there is none)."""
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": f"{text}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


class GenericParser(ToolCallParser):
    """The generic answer object, streamed (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._scanner = ObjectScanner()
        self._raw: list[str] = []  # the text so far, given back as content if it is not an answer object
        self._key: str | None = None
        self._call: CallScanner | None = None
        self._list: ToolCallParser | None = None
        self._text = JsonStringDecoder()
        self._raw_response: bool | None = None

    def _run(self, out: ParserDelta) -> None:
        text, self._buffer = self._buffer, ""
        if self._mode == "content_only":
            self._content(text, out)
            return
        for at, char in enumerate(text):
            if self._scanner.done:
                break
            self._raw.append(char)
            for event in self._scanner.push(char):
                if isinstance(event, ScanError) and self._key is None:  # not an answer object: text
                    self._mode = "content_only"
                    self._content("".join(self._raw) + text[at + 1:], out)
                    return
                elif isinstance(event, ValueStart) and self._key is None:
                    self._start(event.key)
                elif isinstance(event, ValueText) and event.key == self._key:
                    self._value(event.text, out)

    def finish(self) -> ParserDelta:
        out = ParserDelta()
        self._run(out)
        if self._key is None and self._mode != "content_only":  # no answer object came: it was text
            self._content("".join(self._raw), out)
        if self._list is not None:
            sub = self._list.finish()
            out.tool_calls += sub.tool_calls
        return merged(out)

    def _start(self, key: str) -> None:
        if key in ("tool_call", "tool_calls", "response"):
            self._key = key
            if key == "tool_call":
                self._call = CallScanner(0)
            elif key == "tool_calls":
                self._list = JsonListParser()  # the list of calls "required" makes, with "arguments"

    def _value(self, text: str, out: ParserDelta) -> None:
        if self._key == "response":  # a string is decoded; a structured response (response_format) stays JSON
            if self._raw_response is None:
                self._raw_response = text != '"'
            out.content += text if self._raw_response else self._text.push(text)
        elif self._call is not None:
            if not self._call.done:
                self._call.push(text, out.tool_calls)
        elif self._list is not None:
            out.tool_calls += self._list.feed(text).tool_calls


class JsonStringDecoder:
    """A JSON string literal, character by character, decoded as it comes (escapes and surrogate pairs)."""

    _SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}

    def __init__(self) -> None:
        self._started = self._done = False
        self._escape: str | None = None  # the escape read so far (after the backslash)
        self._high: str = ""  # a high surrogate waiting for its pair

    def push(self, char: str) -> str:
        if self._done:
            return ""
        if not self._started:
            self._started = char == '"'
            return ""
        if self._escape is not None:
            return self._escaped(char)
        if char == "\\":
            self._escape = ""
            return ""
        if char == '"':
            self._done = True
            return self._flush_high()
        return self._flush_high() + char

    def _escaped(self, char: str) -> str:
        escape = self._escape + char
        if escape[0] != "u":
            self._escape = None
            return self._flush_high() + self._SIMPLE.get(char, char)
        if len(escape) < 5:
            self._escape = escape
            return ""
        self._escape = None
        try:
            code = int(escape[1:], 16)
        except ValueError:
            return self._flush_high() + "\\" + escape
        if 0xD800 <= code < 0xDC00:
            flushed, self._high = self._flush_high(), chr(code)
            return flushed
        if 0xDC00 <= code < 0xE000 and self._high:
            pair = (self._high + chr(code)).encode("utf-16", "surrogatepass").decode("utf-16")
            self._high = ""
            return pair
        return self._flush_high() + chr(code)

    def _flush_high(self) -> str:
        high, self._high = self._high, ""
        return high.encode("utf-16", "surrogatepass").decode("utf-16", "replace") if high else ""
