"""gpt-oss's "harmony" output: messages on channels, parsed into reasoning, content and tool calls (pure text).

    <|channel|>analysis<|message|>thinking...<|end|>                               -> reasoning
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
                                                                                   -> a call of NAME
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>              -> content

The recipient may also stand before the channel (`assistant to=functions.NAME<|channel|>commentary`,
as the template renders history). A commentary message without a recipient is a preamble: content.
Output that never opens a message (no <|message|>) is content, released at the end.
"""

from __future__ import annotations

import re

from metrale.text.tool_calls import ParserDelta, ToolCallParser, merged, partial_suffix

MESSAGE = "<|message|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonyParser(ToolCallParser):
    def __init__(self) -> None:
        super().__init__()
        self._mode = "header"
        self._kind = "content"  # the open message's: "reasoning" | "content" | "call"

    def _run(self, out: ParserDelta) -> None:
        while True:
            if self._mode == "header":
                header = self._take_until(MESSAGE)
                if header is None:
                    return
                self._open(header, out)
                self._mode = "body"
            else:
                ended = self._body(out)
                if not ended:
                    return
                if self._kind == "call":
                    self._end_call()
                    self._drop_whitespace = False
                self._mode = "header"

    def finish(self) -> ParserDelta:
        out = ParserDelta()
        self._run(out)
        if self._mode == "header":  # never a message: plain text
            self._content(self._buffer, out)
        else:
            self._emit(self._buffer, out)
        self._buffer = ""
        return merged(out)

    def _open(self, header: str, out: ParserDelta) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1).startswith("functions."):
            self._kind = "call"
            self._name(recipient.group(1).removeprefix("functions."), out)
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:  # final, a commentary preamble, or no channel
            self._kind = "content"

    def _body(self, out: ParserDelta) -> bool:
        """Stream the message body; True once its end marker was consumed."""
        found = [(at, marker) for marker in BODY_ENDS if (at := self._buffer.find(marker)) >= 0]
        if found:
            at, marker = min(found)
            self._emit(self._buffer[:at], out)
            # <|start|> opens the next message: its header follows
            self._buffer = self._buffer[at + (len(marker) if marker != "<|start|>" else 0):]
            return True
        keep = max(partial_suffix(self._buffer, marker) for marker in BODY_ENDS)
        self._emit(self._buffer[:len(self._buffer) - keep], out)
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _emit(self, text: str, out: ParserDelta) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            out.reasoning += text
        elif self._kind == "call":
            self._arguments(text, out)
        else:
            self._content(text, out)
