"""Tool calls in model output, for the formats of the families metrale loads (pure text, never mlx).

    hermes        Qwen 2.5/3, Hermes, many fine-tunes:
                  text <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    llama3_json   Llama 3.1+ with JSON tools: [<|python_tag|>]{"name": ..., "parameters": {...}}; {...}
                  (a tool call only when the output starts with the object)
    mistral       Mistral v0.3 / Nemo: text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    json_list     [{"name": ..., "parameters": {...}}, ...]: what tool_choice "required" makes any model
                  write (vLLM's convention; the grammar enforces it)
    NamedCallParser   the whole output is the arguments of one named call (tool_choice naming a function)

A parser takes the output text as it streams (`feed`, split anywhere, even inside a marker or a
character escape) and returns what can be said so far: content text, and tool-call deltas in OpenAI's
streaming shape (a call's first delta carries its name, later ones fragments of its arguments' JSON
text, exactly as generated). `finish()` releases what was held back. `parse_tool_calls` runs the same
parser over a whole text, so a stream's deltas always add up to the non-streamed result. An object
that turns out not to be a call (no "name", not JSON) before its name was known is given back as content.
"""

from __future__ import annotations

from metrale.text.tool_calls import (ParsedOutput, ParserDelta, ToolCallDelta, ToolCallParser, collect, merged)

__all__ = ["FORMATS", "HermesParser", "JsonListParser", "Llama3JsonParser", "MistralParser", "NamedCallParser",
           "ParsedOutput", "ParserDelta", "ToolCallDelta", "ToolCallParser", "detect_format", "make_parser",
           "parse_tool_calls"]
_WHITESPACE = " \t\r\n"


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
                if head.startswith(self.TAG):
                    head = head[len(self.TAG):].lstrip(_WHITESPACE)
                elif self.TAG.startswith(head) and head:
                    return  # maybe the tag
                if not head:
                    return
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
            else:  # content_only: no (more) calls
                self._content(self._buffer, out)
                self._buffer = ""
                return


class MistralParser(ToolCallParser):
    MARKER = "[TOOL_CALLS]"

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
            elif self._mode == "list":  # expect '['
                if not self._skip_whitespace():
                    return
                if self._buffer[0] != "[":
                    self._not_a_list(out)
                    self._mode = "content"
                    continue
                self._buffer = self._buffer[1:]
                self._mode = "item"
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


class JsonListParser(MistralParser):
    """A JSON list of calls from the first character on (tool_choice "required")."""

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


FORMATS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                            "mistral": MistralParser, "json_list": JsonListParser}


def make_parser(fmt: str) -> ToolCallParser:
    """A fresh streaming parser for `fmt` (one of FORMATS)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; choose one of {sorted(FORMATS)}")
    return FORMATS[fmt]()


def detect_format(chat_template: str | None) -> str | None:
    """The tool call format a chat template teaches its model, or None when it shows no tool calls."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None


def parse_tool_calls(fmt: str, text: str) -> ParsedOutput:
    """A whole output's content and tool calls (the same parser as streaming, fed at once)."""
    parser = make_parser(fmt)
    return collect([parser.feed(text), parser.finish()])
