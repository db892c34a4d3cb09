"""Which parsers read a chat model's output, chosen from its chat template (pure text, never mlx).

    template shows                                  tool-call format   (metrale.text.tool_parsers and friends)
    <|channel|>                                      harmony            gpt-oss (reasoning on the analysis channel)
    <｜tool▁calls▁begin｜>                             deepseek           DeepSeek R1 / V3 / V3.1
    <tool_call> with <function= and <parameter=      qwen3_coder        Qwen3-Coder, Qwen3.5, Nemotron 3
    <arg_key>, <invoke name=, <tool_calls>, <function=  None            (GLM, MiniMax, Apriel, Functionary: generic)
    <tool_call>                                      hermes             Qwen 2.5 / 3, QwQ, Hermes, Granite 4
    <|tool_call|>                                    granite            Granite 3.x
    [TOOL_CALLS]                                     mistral            Mistral v3 lists and v11+ name[ARGS]
    <|python_tag|> or an ipython turn                llama3_json        Llama 3.1 / 3.2 / 3.3
    <|tool_call_start|>                              pythonic           LFM2
    anything else                                    None               -> "generic" (metrale.text.generic_tools)

`ChatOutputParser` runs a reasoning parser (metrale.text.reasoning) in front of a tool-call parser: the
tool parser sees only the answer, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

from metrale.text.generic_tools import GenericParser
from metrale.text.harmony import HarmonyParser
from metrale.text.reasoning import ReasoningParser
from metrale.text.tool_calls import ParsedOutput, ParserDelta, ToolCallParser, collect, merged
from metrale.text.tool_formats import DeepSeekParser, PythonicParser, Qwen3CoderParser
from metrale.text.tool_parsers import GraniteParser, HermesParser, JsonListParser, Llama3JsonParser, MistralParser

Tools = Sequence[Mapping[str, Any]]

FORMATS: dict[str, Callable[[Tools], ToolCallParser]] = {
    "hermes": lambda tools: HermesParser(), "llama3_json": lambda tools: Llama3JsonParser(),
    "mistral": lambda tools: MistralParser(), "qwen3_coder": Qwen3CoderParser,
    "deepseek": lambda tools: DeepSeekParser(), "granite": lambda tools: GraniteParser(),
    "pythonic": lambda tools: PythonicParser(), "harmony": lambda tools: HarmonyParser(),
    "generic": lambda tools: GenericParser(), "json_list": lambda tools: JsonListParser(),
}
CHOOSABLE = tuple(f for f in FORMATS if f != "json_list")  # what --tool-call-parser accepts
# formats whose markers are special tokens: the output must be decoded with them
SPECIAL_MARKERS = frozenset({"llama3_json", "mistral", "deepseek", "granite", "pythonic", "harmony"})


# formats metrale does not read (GLM's XML, MiniMax's invoke, <tool_calls> lists, Functionary v3.1): generic
_UNREAD = ("<arg_key>", "<invoke name=", "<tool_calls>", "<function=")


def make_parser(fmt: str, tools: Tools = ()) -> ToolCallParser:
    """A fresh streaming parser for `fmt` (one of FORMATS); `tools` type the values of XML formats."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; choose one of {sorted(FORMATS)}")
    return FORMATS[fmt](tools)


def detect_format(chat_template: str | None) -> str | None:
    """The tool call format a chat template teaches its model (table above), or None when it shows none
    metrale reads (the server then uses the generic format)."""
    if not chat_template:
        return None
    t = chat_template
    if "<|channel|>" in t:
        return "harmony"
    if "<｜tool▁calls▁begin｜>" in t:
        return "deepseek"
    if "<tool_call>" in t and "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if any(marker in t for marker in _UNREAD):
        return None
    if "<tool_call>" in t:
        return "hermes"
    if "<|tool_call|>" in t:
        return "granite"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    if "<|tool_call_start|>" in t:
        return "pythonic"
    return None


def parse_tool_calls(fmt: str, text: str, tools: Tools = ()) -> ParsedOutput:
    """A whole output's content and tool calls (the same parser as streaming, fed at once)."""
    parser = make_parser(fmt, tools)
    return collect([parser.feed(text), parser.finish()])


class ChatOutputParser:
    """Reasoning, then tool calls: the `feed`/`finish` of a ToolCallParser over both (either may be None)."""

    def __init__(self, tools: ToolCallParser | None, reasoning: ReasoningParser | None) -> None:
        self.tools = tools
        self.reasoning = reasoning

    def feed(self, text: str) -> ParserDelta:
        if self.reasoning is None:
            return self._answer(text, final=False)
        reasoning, content = self.reasoning.feed(text)
        out = self._answer(content, final=False)
        out.reasoning = reasoning + out.reasoning
        return out

    def finish(self) -> ParserDelta:
        if self.reasoning is None:
            return self._answer("", final=True)
        reasoning, content = self.reasoning.finish()
        out = self._answer(content, final=True)
        out.reasoning = reasoning + out.reasoning
        return out

    def _answer(self, text: str, final: bool) -> ParserDelta:
        if self.tools is None:
            return ParserDelta(content=text)
        out = self.tools.feed(text) if text else ParserDelta()
        if final:
            last = self.tools.finish()
            out.content += last.content
            out.reasoning += last.reasoning
            out.tool_calls += last.tool_calls
        return merged(out)
