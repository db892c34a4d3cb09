"""How a chat response's output is read and answered: reasoning, then tool calls (metrale.server.tools plans
the tools), into OpenAI's message fields, streamed and not.

    output text --ChatOutputParser--> reasoning | content | tool-call deltas
                --ToolCallStream-->   delta {"reasoning_content", "content", "tool_calls"} / the message

A response with calls has `message.tool_calls` (streamed as OpenAI does: per call a first delta with
index, id, type and name, then fragments of the arguments' JSON text) and finish_reason "tool_calls"
("stop" for a named function, as OpenAI). Which reasoning parser runs: --reasoning-parser, else what the
engine reads from the chat template; where the output starts (inside a <think> block the template opened,
or not) is read from the prompt's last tokens.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from metrale.sampling_params import SamplingParams
from metrale.server.tools import ToolPlan
from metrale.text.output_parsing import SPECIAL_MARKERS, ChatOutputParser
from metrale.text.harmony import HarmonyParser
from metrale.text.reasoning import HARMONY, ReasoningParser
from metrale.text.reasoning import MARKERS as REASONING_MARKERS
from metrale.text.tool_calls import ParserDelta, collect

REASONING_FORMATS = (*sorted(REASONING_MARKERS), HARMONY)  # what --reasoning-parser takes (and "none")
_TAIL_TOKENS = 16  # prompt tokens decoded to see whether the template opened (or closed) a reasoning block


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """How one chat response's output is read: reasoning (a metrale.text.reasoning format), then tool calls."""

    tools: ToolPlan | None
    reasoning: str | None
    include_reasoning: bool = True  # vLLM's include_reasoning: false drops the reasoning text

    def params(self, params: SamplingParams) -> SamplingParams:
        """Formats whose markers are special tokens need them decoded."""
        fmt = self.tools.fmt if self.tools is not None and self.tools.choice == "auto" else None
        if params.skip_special_tokens and (fmt in SPECIAL_MARKERS or self.reasoning in ("mistral", "seed_oss", HARMONY)):
            return msgspec.structs.replace(params, skip_special_tokens=False)
        return params

    def stream(self, prompt_tail: str = "") -> "ToolCallStream":
        """The parser state of one output that follows a prompt ending in `prompt_tail`."""
        tools = self.tools.parser() if self.tools is not None else None
        if self.reasoning == HARMONY:  # gpt-oss: its channels carry the reasoning, with or without tools
            return ToolCallStream(ChatOutputParser(tools or HarmonyParser(), None),
                                  include_reasoning=self.include_reasoning)
        reasoning = ReasoningParser.for_prompt(self.reasoning, prompt_tail) if self.reasoning else None
        forced = self.tools is not None and self.tools.choice == "named"
        return ToolCallStream(ChatOutputParser(tools, reasoning), forced=forced,
                              include_reasoning=self.include_reasoning)


def output_plan(tool_plan: ToolPlan | None, reasoning: str | None, include_reasoning: bool = True) -> OutputPlan | None:
    """The plan of a chat response, None when its output is plain content. No reasoning is read when a
    grammar holds the output to a call (it has none)."""
    parsed = tool_plan if tool_plan is not None and tool_plan.parses_calls else None
    if parsed is not None and parsed.constrains_output:
        reasoning = None
    if reasoning is not None and reasoning not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning parser {reasoning!r}; choose one of {REASONING_FORMATS}")
    if parsed is None and reasoning is None:
        return None
    return OutputPlan(parsed, reasoning, include_reasoning)


@dataclass(slots=True)
class ToolCallStream:
    """One response's tool-call parsing: text deltas in, OpenAI `delta` fields out."""

    parser: ChatOutputParser
    forced: bool = False  # a named function: finish_reason stays "stop"
    include_reasoning: bool = True
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
        if parsed.reasoning and self.include_reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["content"] = parsed.content if parsed.content.strip() else None
            message["tool_calls"] = [{"id": self.ids[i], "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}
                                     for i, call in enumerate(parsed.tool_calls)]
        return message

    def _fields(self, delta: ParserDelta) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if delta.reasoning and self.include_reasoning:
            fields["reasoning_content"] = delta.reasoning
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


def arguments_object(text: str) -> Any:
    """A parsed call's arguments as an object (Anthropic's `input`, Ollama's `arguments`) from the JSON text the
    parser assembled: {} when empty; a model's text that is not JSON is handed over as {"_raw_arguments": text}."""
    if not text.strip():
        return {}
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return {"_raw_arguments": text}


def reasoning_format(override: str | None, engine: Any) -> str | None:
    """The server's --reasoning-parser ("none": off), else what the engine reads from the chat template."""
    if override is not None:
        return None if override == "none" else override
    return engine.reasoning_format


def prompt_tail(engine: Any, prompt_ids: list[int]) -> str:
    """The last tokens of the prompt as text (special tokens kept): whether the template opened reasoning."""
    return engine.decode(prompt_ids[-_TAIL_TOKENS:])
