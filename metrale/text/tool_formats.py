"""More tool-call formats (pure text, never mlx); the JSON families are in metrale.text.tool_parsers.

    deepseek      DeepSeek R1 / V3:  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                                     ```json {...} ```<｜tool▁call▁end｜> ... <｜tool▁calls▁end｜>
                  DeepSeek V3.1:     <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
    qwen3_coder   Qwen3-Coder, Qwen3.5: <tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n
                  </function>\\n</tool_call>; each value typed by the tool's parameter schema
    pythonic      Llama 4, LFM2, ...: [f(a=1, b="x"), g()] as the whole output, or between
                  <|tool_call_start|> and <|tool_call_end|>

Each parser streams like the others (metrale.text.tool_calls.ToolCallParser): text split anywhere,
the name of a call as soon as it is complete, then its arguments' JSON text.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

from metrale.text.tool_calls import ParserDelta, ToolCallDelta, ToolCallParser

_WHITESPACE = " \t\r\n"


class DeepSeekParser(ToolCallParser):
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def _run(self, out: ParserDelta) -> None:
        while True:
            mode = self._mode
            if mode == "content":
                if not self._content_until(self.CALLS_BEGIN, out):
                    return
                self._mode = "next"
            elif mode == "next":  # another call, or the end of the calls
                found = self._expect(self.CALL_BEGIN)
                if found is None:
                    return
                if found:
                    self._mode = "head"
                elif self._expect(self.CALLS_END) is None:
                    return
                else:
                    self._mode = "content"
            elif mode == "head":  # "function" (R1 / V3) or the name (V3.1), up to the separator
                head = self._take_until(self.SEP)
                if head is None:
                    return
                if head.strip() == "function":
                    self._mode = "r1_name"
                else:
                    self._name(head.strip(), out)
                    self._mode = "arguments"
            elif mode == "r1_name":
                name = self._take_until("\n")
                if name is None:
                    return
                self._name(name.strip(), out)
                self._mode = "fence"
            elif mode == "fence":  # ```json (optional)
                found = self._expect("```json")
                if found is None:
                    return
                self._mode = "arguments"
            elif mode == "arguments":
                if self._push_arguments(out) is None:
                    return
                self._mode = "close"
            else:  # close: an optional ``` then the call's end marker
                if self._expect("```") is None or self._expect(self.CALL_END) is None:
                    return
                self._drop_whitespace = False
                self._mode = "next"


class Qwen3CoderParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"
    FUNCTION, PARAMETER = "<function=", "<parameter="

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__()
        self._schemas = parameter_schemas(tools)
        self._function = ""
        self._parameter = ""
        self._num_parameters = 0

    def _opening(self) -> str:
        return self.START

    def _run(self, out: ParserDelta) -> None:
        while True:
            mode = self._mode
            if mode == "content":
                if not self._content_until(self.START, out):
                    return
                self._mode = "function"
            elif mode == "function":
                found = self._expect(self.FUNCTION)
                if found is None:
                    return
                if not found:  # not this format's call: the tag was text
                    self._content(self.START, out)
                    self._mode = "content"
                    continue
                self._mode = "name"
            elif mode == "name":
                name = self._take_until(">")
                if name is None:
                    return
                self._function, self._num_parameters = name.strip(), 0
                self._name(self._function, out)
                self._mode = "parameter"
            elif mode == "parameter":
                if not self._parameter_or_end(out):
                    return
            elif mode == "value":
                value = self._take_until("</parameter>")
                if value is None:
                    return
                self._add_parameter(value, out)
                self._mode = "parameter"
            else:  # close: </tool_call>
                if self._expect(self.END) is None:
                    return
                self._mode = "content"

    def _parameter_or_end(self, out: ParserDelta) -> bool:
        found = self._expect(self.PARAMETER)
        if found is None:
            return False
        if found:
            name = self._take_until(">")
            if name is None:
                self._buffer = self.PARAMETER + self._buffer
                return False
            self._parameter = name.strip()
            self._mode = "value"
            return True
        ended = self._expect("</function>")
        if ended is None:
            return False
        self._arguments("}" if self._num_parameters else "{}", out)
        self._end_call()
        self._mode = "close"
        return True

    def _add_parameter(self, raw: str, out: ParserDelta) -> None:
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        schema = self._schemas.get(self._function, {}).get(self._parameter, {})
        text = json.dumps(typed_value(value, schema), ensure_ascii=False)
        prefix = "{" if self._num_parameters == 0 else ", "
        self._arguments(f"{prefix}{json.dumps(self._parameter, ensure_ascii=False)}: {text}", out)
        self._num_parameters += 1


class PythonicParser(ToolCallParser):
    START, END = "<|tool_call_start|>", "<|tool_call_end|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"
        self._marked = False  # the list came between START and END
        self._scan = _ListScan()

    def _run(self, out: ParserDelta) -> None:
        while True:
            mode = self._mode
            if mode == "start":  # a list as the whole output, or text before a marked list
                head = self._buffer.lstrip(_WHITESPACE)
                if not head or (self.START.startswith(head) and head != self.START):
                    return
                self._mode = "list" if head[0] == "[" else "content"
                if head[0] == "[":
                    self._buffer = head
            elif mode == "content":
                if not self._content_until(self.START, out):
                    return
                self._marked, self._mode = True, "list"
            elif mode == "list":
                end = self._scan.end(self._buffer)
                if end is None:
                    return
                text, self._buffer = self._buffer[:end], self._buffer[end:]
                self._scan = _ListScan()
                self._mode = "close" if self._emit_list(text, out) and self._marked else "content"
            else:  # close
                if self._expect(self.END) is None:
                    return
                self._mode = "content"

    def _emit_list(self, text: str, out: ParserDelta) -> bool:
        calls = pythonic_calls(text)
        if calls is None:
            self._content((self.START if self._marked else "") + text, out)
            return False
        for name, arguments in calls:
            out.tool_calls.append(ToolCallDelta(self._num_calls, name=name, arguments=arguments))
            self._end_call()
        return True

    def finish(self) -> ParserDelta:
        if self._mode == "list":  # an unfinished list is text
            self._content((self.START if self._marked else "") + self._buffer, out := ParserDelta())
            self._buffer, self._mode = "", "content"
            return out
        return super().finish()


class _ListScan:
    """Where a Python list literal that starts the text ends (brackets counted outside strings)."""

    __slots__ = ("pos", "depth", "quote", "escape")

    def __init__(self) -> None:
        self.pos, self.depth, self.quote, self.escape = 0, 0, "", False

    def end(self, text: str) -> int | None:
        while self.pos < len(text):
            char = text[self.pos]
            self.pos += 1
            if self.quote:
                if self.escape:
                    self.escape = False
                elif char == "\\":
                    self.escape = True
                elif char == self.quote:
                    self.quote = ""
            elif char in "'\"":
                self.quote = char
            elif char in "[({":
                self.depth += 1
            elif char in "])}":
                self.depth -= 1
                if self.depth == 0:
                    return self.pos
        return None


def pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] of `[f(a=1), g()]`, or None when the text is not such a list."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        except ValueError:
            return None
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def parameter_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{function name: {parameter name: its JSON schema}} of OpenAI-shaped tools."""
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        schemas[function.get("name", "")] = dict(properties) if isinstance(properties, Mapping) else {}
    return schemas


def typed_value(text: str, schema: Mapping[str, Any]) -> Any:
    """A parameter's text as the value its schema asks for: a string parameter keeps the text, others
    are read as JSON (or a Python literal: True, None, 'x'); the text itself when that fails."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = kind if isinstance(kind, list) else [kind]
    stripped = text.strip()
    if "string" in kinds:
        return None if "null" in kinds and stripped == "null" else text
    if "boolean" in kinds and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    try:
        value = json.loads(stripped)
    except ValueError:
        try:
            value = ast.literal_eval(stripped)
            json.dumps(value)  # a set or bytes is no JSON value
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return text
    return value
