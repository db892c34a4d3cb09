"""Reasoning in model output: the text between a start and an end marker, split from the answer (pure text).

    think     Qwen3, QwQ, DeepSeek R1 / V3.1, SmolLM3, GLM, ...:  <think> reasoning </think> answer
    mistral   Magistral / Ministral reasoning:                   [THINK] reasoning [/THINK] answer
    harmony   gpt-oss's analysis channel: read by metrale.text.harmony's parser, with its tool calls

Where the output starts depends on the prompt: a template that opens the block itself (DeepSeek R1's
"<think>\\n" generation prompt) makes the whole output reasoning until the end marker; one that closed
it (Qwen3 with enable_thinking=false) makes it all answer; otherwise reasoning starts only when the
output opens with the start marker. `ReasoningParser.for_prompt` reads that from the prompt's tail.
A reasoning block that never ends (max_tokens) is all reasoning, as in vLLM.
"""

from __future__ import annotations

from metrale.text.tool_calls import partial_suffix

MARKERS: dict[str, tuple[str, str]] = {"think": ("<think>", "</think>"), "mistral": ("[THINK]", "[/THINK]"),
                                       "seed_oss": ("<seed:think>", "</seed:think>")}
_WHITESPACE = " \t\r\n"


class ReasoningParser:
    """Streams (reasoning, content) pairs out of output text split anywhere."""

    def __init__(self, fmt: str, *, opened: bool | None = None) -> None:
        """`opened`: True when the prompt opened the block, False when it closed it, None: the output decides."""
        if fmt not in MARKERS:
            raise ValueError(f"unknown reasoning format {fmt!r}; choose one of {sorted(MARKERS)}")
        self.start, self.end = MARKERS[fmt]
        self._mode = {True: "reasoning_start", False: "content", None: "maybe"}[opened]
        self._buffer = ""

    @classmethod
    def for_prompt(cls, fmt: str, prompt_tail: str) -> "ReasoningParser":
        """The parser for an output that follows a prompt ending in `prompt_tail` (its last few tokens)."""
        start, end = MARKERS[fmt] if fmt in MARKERS else ("", "")
        opened_at, closed_at = prompt_tail.rfind(start), prompt_tail.rfind(end)
        opened = None if opened_at < 0 and closed_at < 0 else opened_at > closed_at
        return cls(fmt, opened=opened)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that this piece of output makes certain."""
        self._buffer += text
        reasoning, content = [], []
        while self._buffer:
            mode = self._mode
            if mode in ("maybe", "reasoning_start"):  # a leading start marker is dropped
                head = self._buffer.lstrip(_WHITESPACE)
                if not head or (self.start.startswith(head) and head != self.start):
                    break
                if head.startswith(self.start):
                    self._buffer = head[len(self.start):]
                    self._mode = "reasoning"
                else:
                    self._mode = "reasoning" if mode == "reasoning_start" else "content"
            elif mode == "reasoning":
                at = self._buffer.find(self.end)
                if at >= 0:
                    reasoning.append(self._buffer[:at])
                    self._buffer = self._buffer[at + len(self.end):]
                    self._mode = "after"
                    continue
                keep = partial_suffix(self._buffer, self.end)
                reasoning.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            elif mode == "after":  # whitespace between the block and the answer is dropped
                self._buffer = self._buffer.lstrip(_WHITESPACE)
                if self._buffer:
                    self._mode = "content"
            else:
                content.append(self._buffer)
                self._buffer = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back: a partial marker is text of the part it was in."""
        reasoning, content = self.feed("")
        rest, self._buffer = self._buffer, ""
        if self._mode == "reasoning":
            return reasoning + rest, content
        if self._mode == "after":
            return reasoning, content
        return reasoning, content + rest


HARMONY = "harmony"  # not a ReasoningParser format: the harmony tool-call parser splits it


def detect_reasoning(chat_template: str | None) -> str | None:
    """The reasoning format a chat template shows (MARKERS' names or "harmony"), or None."""
    if not chat_template:
        return None
    if "<|channel|>" in chat_template:
        return HARMONY
    for fmt in ("seed_oss", "mistral", "think"):
        if MARKERS[fmt][0] in chat_template:
            return fmt
    return None
