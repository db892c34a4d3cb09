"""Tool calls in model output, for the formats of the families metrale loads (pure text, never mlx).

    hermes        Qwen 2.5/3, Hermes, many fine-tunes:
                  text <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    llama3_json   Llama 3.1+ with JSON tools: [<|python_tag|>]{"name": ..., "parameters": {...}}; {...}
                  (a tool call only when the output starts with the object), and Llama 3.1's built-in
                  tools: <|python_tag|>brave_search.call(query="...") (read when the output ends)
    mistral       Mistral v0.3 / Nemo: text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                  Mistral Small 3.2 / Devstral / Magistral (v11+): text [TOOL_CALLS]name[ARGS]{...}
                  (also name[CALL_ID]id[ARGS]{...}), one marker per call
    granite       Granite 3.x: text <|tool_call|>[{"name": ..., "arguments": {...}}, ...]
    json_list     [{"name": ..., "parameters": {...}}, ...]: what tool_choice "required" makes any model
                  write (vLLM's convention; the grammar enforces it)
    NamedCallParser   the whole output is the arguments of one named call (tool_choice naming a function)

A parser takes the output text as it streams (`feed`, split anywhere, even inside a marker or a
character escape) and returns what can be said so far: content text, and tool-call deltas in OpenAI's
streaming shape (a call's first delta carries its name, later ones fragments of its arguments' JSON
text, exactly as generated). `finish()` releases what was held back. `parse_tool_calls` runs the same
parser over a whole text (metrale.text.output_parsing, which also picks the format), so a stream's deltas always add up to the non-streamed result. An object
that turns out not to be a call (no "name", not JSON) before its name was known is given back as content.
"""

from __future__ import annotations

import ast
import json
import re

from metrale.text.tool_calls import (ParsedOutput, ParserDelta, ToolCallDelta, ToolCallParser, merged,
                                     partial_suffix)

__all__ = ["GraniteParser", "HermesParser", "JsonListParser", "Llama3JsonParser", "MistralParser",
           "NamedCallParser", "ParsedOutput", "ParserDelta", "ToolCallDelta", "ToolCallParser"]
_WHITESPACE = " \t\r\n"
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def _opening(self) -> str:
        return self.START

    def _run(self, out: ParserDelta) -> None:
        while True:
            if self._mode == "content":
                if not self._content_until(self.START, out):
                    return
                self._mode = "call"
                self._start_call()
            elif self._mode == "call":
                found = self._push_call(out)
                if found is None:
                    return
                self._mode = "close" if found else "content"
            elif self._mode == "close":  # expect </tool_call>
                if not self._skip_whitespace() or (len(self._buffer) < len(self.END)
                                                   and self.END.startswith(self._buffer)):
                    return
                if self._buffer.startswith(self.END):
                    self._buffer = self._buffer[len(self.END):]
                self._mode = "content"


class Llama3JsonParser(ToolCallParser):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"
        self._held = ""  # leading text held until the first character decides

    def _opening(self) -> str:
        opening, self._held = self._held, ""
        return opening

    def _run(self, out: ParserDelta) -> None:
        while True:
            if self._mode == "start":
                head = self._buffer.lstrip(_WHITESPACE)
                tagged = head.startswith(self.TAG)
                if tagged:
                    head = head[len(self.TAG):].lstrip(_WHITESPACE)
                elif self.TAG.startswith(head) and head:
                    return  # maybe the tag
                if not head:
                    return
                if head[0] != "{" and tagged:  # a built-in tool: <|python_tag|>brave_search.call(query="...")
                    self._mode = "builtin"
                    continue
                if head[0] != "{":
                    self._mode = "content_only"
                    continue
                self._held, self._buffer = self._buffer[:len(self._buffer) - len(head)], head
                self._mode = "call"
                self._start_call()
            elif self._mode == "call":
                found = self._push_call(out)
                if found is None:
                    return
                self._mode = "between" if found else "content_only"
            elif self._mode == "between":  # calls are separated by ';'
                if not self._skip_whitespace():
                    return
                if self._buffer[0] == ";":
                    self._buffer = self._buffer[1:]
                    self._mode = "next"
                else:
                    self._mode = "content_only"
            elif self._mode == "next":
                if not self._skip_whitespace():
                    return
                self._mode = "call"
                self._start_call()
            elif self._mode == "builtin":  # held until the end: the whole output is the call
                return
            else:  # content_only: no (more) calls
                self._content(self._buffer, out)
                self._buffer = ""
                return

    def finish(self) -> ParserDelta:
        if self._mode != "builtin":
            return super().finish()
        out = ParserDelta()
        code = self._buffer.strip(_WHITESPACE).removeprefix(self.TAG)
        call = builtin_call(code)
        if call is None:
            self._content(self._buffer, out)
        else:
            out.tool_calls.append(ToolCallDelta(0, name=call[0], arguments=call[1]))
        self._buffer, self._mode = "", "content_only"
        return out


def builtin_call(code: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of Llama 3.1's built-in tool call `name.call(key="value", ...)`, else None."""
    try:
        node = ast.parse(code.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "call"
            and isinstance(node.func.value, ast.Name) and not node.args):
        return None
    try:
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except ValueError:
        return None
    return node.func.value.id, json.dumps(arguments, ensure_ascii=False)


class MistralParser(ToolCallParser):
    """Both Mistral formats: [TOOL_CALLS][{...}, ...] (v3 tokenizers) and, from v11 on,
    [TOOL_CALLS]name[ARGS]{...} (or name[CALL_ID]id[ARGS]{...}), one marker per call."""

    MARKER = "[TOOL_CALLS]"
    NAMED_CALLS = True  # v11's name[ARGS]{...} after the marker
    ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"

    def _opening(self) -> str:
        return self.MARKER + "[" if self._num_calls == 0 else ""

    def _not_a_list(self, out: ParserDelta) -> None:
        self._content(self.MARKER, out)

    def _run(self, out: ParserDelta) -> None:
        while True:
            if self._mode == "content":
                if not self._content_until(self.MARKER, out):
                    return
                self._mode = "list"
            elif self._mode == "list":  # expect '[' (v3) or, right after the marker, a function name (v11)
                head = self._buffer.lstrip(_WHITESPACE)
                if not head:
                    return
                if head[0] == "[":
                    self._buffer = head[1:]
                    self._mode = "item"
                elif self.NAMED_CALLS and head == self._buffer:
                    self._mode = "name"
                else:  # not a call: the marker and what follows are text
                    self._not_a_list(out)
                    self._mode = "content"
            elif self._mode == "name":
                if not self._named_call(out):
                    return
            elif self._mode == "arguments":
                if self._push_arguments(out) is None:
                    return
                self._mode = "content"
            elif self._mode == "item":
                if not self._skip_whitespace():
                    return
                self._mode = "call"
                self._start_call()
            elif self._mode == "call":
                found = self._push_call(out)
                if found is None:
                    return
                self._mode = "separator" if found else "content"
            elif self._mode == "separator":  # ',' then the next call, or ']'
                if not self._skip_whitespace():
                    return
                char, self._buffer = self._buffer[0], self._buffer[1:]
                self._mode = "item" if char == "," else "content"

    def _named_call(self, out: ParserDelta) -> bool:
        """v11: name[ARGS] or name[CALL_ID]id[ARGS]; False: wait for more text."""
        ends = [at for at in (self._buffer.find(self.ARGS), self._buffer.find(self.CALL_ID)) if at >= 0]
        at = min(ends) if ends else -1
        keep = max(partial_suffix(self._buffer, self.ARGS), partial_suffix(self._buffer, self.CALL_ID))
        name = self._buffer[:at] if at >= 0 else self._buffer[:len(self._buffer) - keep]
        if not _NAME.fullmatch(name or "a"):  # not a name: the marker was text
            self._not_a_list(out)
            self._mode = "content"
            return True
        if at < 0:
            return False
        rest = self._buffer[at:]
        if rest.startswith(self.CALL_ID):
            end = rest.find(self.ARGS)
            if end < 0:
                return False
            rest = rest[end:]
        self._buffer = rest[len(self.ARGS):]
        self._name(name, out)
        self._mode = "arguments"
        return True


class GraniteParser(MistralParser):
    """Granite 3.x: text <|tool_call|>[{"name": ..., "arguments": {...}}, ...]."""

    MARKER = "<|tool_call|>"
    NAMED_CALLS = False


class JsonListParser(MistralParser):
    """A JSON list of calls from the first character on (tool_choice "required")."""

    NAMED_CALLS = False

    def __init__(self) -> None:
        super().__init__()
        self._mode = "list"

    def _opening(self) -> str:
        return "[" if self._num_calls == 0 else ""

    def _not_a_list(self, out: ParserDelta) -> None:
        pass


class NamedCallParser(ToolCallParser):
    """The whole output is the arguments of the call `name` (tool_choice naming a function)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str) -> ParserDelta:
        out = ParserDelta()
        if self._mode == "content":
            self._mode = "arguments"
            out.tool_calls.append(ToolCallDelta(0, name=self._name))
        if text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return merged(out)

    def finish(self) -> ParserDelta:
        return self.feed("") if self._mode == "content" else ParserDelta()
