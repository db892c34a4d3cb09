"""Tool-call records and the streaming machinery every format's parser shares (pure text, never mlx).

A parser keeps the text it cannot decide yet (a partial marker, an object whose name is not known) and
emits content and ToolCallDelta's as soon as they are certain. Each call's JSON object goes through a
`CallScanner` (metrale.text.json_scan underneath): its "name" is emitted once complete, its "arguments"
(or "parameters") text fragment by fragment, exactly as generated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from metrale.text.json_scan import ObjectEnd, ObjectScanner, ValueEnd, ValueStart, ValueText

_WHITESPACE = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """Part of the tool call number `index` (0, 1, ...): its name once (first), then argument fragments."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParserDelta:
    """What one `feed` (or `finish`) adds: content text, reasoning text and tool-call deltas."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # the arguments' JSON text, as generated


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str
    tool_calls: tuple[ToolCall, ...]
    reasoning: str = ""


class CallScanner:
    """One call's JSON object, scanned as it streams; emits the name, then argument fragments."""

    __slots__ = ("index", "scanner", "name", "raw", "_pending", "_args_key", "_args_started", "_string_args")

    def __init__(self, index: int) -> None:
        self.index = index
        self.scanner = ObjectScanner()
        self.name: str | None = None
        self.raw: list[str] = []  # every character pushed (to give a failed object back as content)
        self._pending: list[str] = []  # argument text seen before the name
        self._args_key: str | None = None
        self._args_started = False
        self._string_args = False  # arguments given as a JSON string: decoded at its end

    @property
    def done(self) -> bool:
        return self.scanner.done

    @property
    def failed(self) -> bool:
        """Done without being a call, or not a call at all: nothing of it was emitted."""
        return self.name is None

    def push(self, char: str, out: list[ToolCallDelta]) -> None:
        self.raw.append(char)
        for event in self.scanner.push(char):
            if isinstance(event, ValueStart) and event.key in ARGUMENT_KEYS and self._args_key is None:
                self._args_key = event.key
            elif isinstance(event, ValueText) and event.key == self._args_key:
                if not self._args_started:
                    self._args_started = True
                    self._string_args = event.text == '"'
                if not self._string_args:
                    self._arguments(event.text, out)
            elif isinstance(event, ValueEnd):
                self._value_end(event, out)
            elif isinstance(event, ObjectEnd) and self.name is not None and self._args_key is None:
                self._arguments("{}", out)  # a call without arguments
            # ScanError: the scanner is done; a call whose name was out stays as far as it got

    def _value_end(self, event: ValueEnd, out: list[ToolCallDelta]) -> None:
        if event.key == "name" and self.name is None:
            try:  # only a string can be a name: a model-written [[[[... 100k deep is never parsed
                name = json.loads(event.raw) if event.raw.startswith('"') else None
            except ValueError:
                name = None
            if isinstance(name, str) and name:
                self.name = name
                out.append(ToolCallDelta(self.index, name=name))
                if self._pending:
                    out.append(ToolCallDelta(self.index, arguments="".join(self._pending)))
                    self._pending = []
        elif event.key == self._args_key and self._string_args:  # "arguments": "{\"a\": 1}"
            try:
                text = json.loads(event.raw)
            except ValueError:
                text = event.raw
            self._string_args = False
            self._arguments(text if isinstance(text, str) else event.raw, out)

    def _arguments(self, text: str, out: list[ToolCallDelta]) -> None:
        if self.name is None:
            self._pending.append(text)
        else:
            out.append(ToolCallDelta(self.index, arguments=text))


class ToolCallParser:
    """Base: text buffering, marker search with the partial-marker tail held back, call bookkeeping."""

    def __init__(self) -> None:
        self._buffer = ""
        self._mode = "content"
        self._call: CallScanner | None = None
        self._num_calls = 0
        self._drop_whitespace = False  # after a call: whitespace before the next content is dropped
        self._args: ArgumentsScanner | None = None  # the arguments of a call named up front

    def feed(self, text: str) -> ParserDelta:
        """The next piece of the output; returns what it makes certain."""
        out = ParserDelta()
        self._buffer += text
        self._run(out)
        return merged(out)

    def finish(self) -> ParserDelta:
        """The output ended: release held-back text; an unfinished object that is not a call is content."""
        out = ParserDelta()
        self._run(out)
        if self._call is not None and self._call.failed:
            self._content(self._opening() + "".join(self._call.raw), out)
        elif self._mode in ("content", "content_only", "start"):
            self._content(self._buffer, out)
        self._buffer, self._call = "", None
        return merged(out)

    # ---- for the formats ----

    def _run(self, out: ParserDelta) -> None:
        raise NotImplementedError

    def _opening(self) -> str:
        """The text that opened the current call (given back as content when it is not a call)."""
        return ""

    def _content(self, text: str, out: ParserDelta) -> None:
        if self._drop_whitespace:
            stripped = text.lstrip(_WHITESPACE)
            if not stripped:
                return
            self._drop_whitespace = False
            text = stripped
        out.content += text

    def _content_until(self, marker: str, out: ParserDelta) -> bool:
        """Emit content up to `marker` and consume it (True); or emit all but a partial marker (False)."""
        at = self._buffer.find(marker)
        if at >= 0:
            self._content(self._buffer[:at], out)
            self._buffer = self._buffer[at + len(marker):]
            return True
        keep = partial_suffix(self._buffer, marker)
        self._content(self._buffer[:len(self._buffer) - keep], out)
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _take_until(self, marker: str) -> str | None:
        """The text before `marker`, consuming both; None (nothing consumed) until the marker is there."""
        at = self._buffer.find(marker)
        if at < 0:
            return None
        taken, self._buffer = self._buffer[:at], self._buffer[at + len(marker):]
        return taken

    def _expect(self, literal: str, skip_whitespace: bool = True) -> bool | None:
        """Consume `literal` if the buffer starts with it (True); None: maybe, wait; False: it does not."""
        if skip_whitespace and not self._skip_whitespace():
            return None
        if self._buffer.startswith(literal):
            self._buffer = self._buffer[len(literal):]
            return True
        return None if literal.startswith(self._buffer) else False

    def _start_call(self) -> None:
        self._call = CallScanner(self._num_calls)

    def _name(self, name: str, out: ParserDelta) -> None:
        """A call whose name is known up front (its arguments follow as _arguments / _push_arguments)."""
        out.tool_calls.append(ToolCallDelta(self._num_calls, name=name))
        self._args = ArgumentsScanner()

    def _arguments(self, text: str, out: ParserDelta) -> None:
        out.tool_calls.append(ToolCallDelta(self._num_calls, arguments=text))

    def _end_call(self) -> None:
        self._num_calls += 1
        self._drop_whitespace = True

    def _push_arguments(self, out: ParserDelta) -> bool | None:
        """Stream the buffered arguments object of a named call; None: it wants more, True: complete,
        False: not a JSON object (the call gets "{}"; the text stays in the buffer)."""
        scanner = self._args
        assert scanner is not None
        consumed, started_before = 0, scanner.started
        for char in self._buffer:
            if scanner.done or not scanner.push(char):
                break
            consumed += 1
        taken, self._buffer = self._buffer[:consumed], self._buffer[consumed:]
        if scanner.started:
            self._arguments(taken if started_before else taken.lstrip(_WHITESPACE), out)
        if scanner.failed:
            self._arguments("{}", out)
        if scanner.failed or scanner.done:
            self._end_call()
            return scanner.done
        return None

    def _push_call(self, out: ParserDelta) -> bool | None:
        """Feed buffered text to the current call; None: it wants more, True: a call, False: not a call."""
        call = self._call
        assert call is not None
        consumed = 0
        for char in self._buffer:
            consumed += 1
            call.push(char, out.tool_calls)
            if call.done:
                break
        self._buffer = self._buffer[consumed:]
        if not call.done:
            return None
        self._call = None
        if call.failed:
            self._content(self._opening() + "".join(call.raw), out)
            return False
        self._num_calls += 1
        self._drop_whitespace = True
        return True

    def _skip_whitespace(self) -> bool:
        """Drop leading whitespace; True when a non-whitespace character is next."""
        self._buffer = self._buffer.lstrip(_WHITESPACE)
        return bool(self._buffer)


class ArgumentsScanner:
    """One call's arguments object, character by character: `push` says whether the character belongs to it."""

    __slots__ = ("depth", "in_string", "escape", "started", "done", "failed")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escape = self.started = self.done = self.failed = False

    def push(self, char: str) -> bool:
        if not self.started:
            if char in _WHITESPACE:
                return True
            if char != "{":
                self.failed = True
                return False
            self.started = True
        if self.in_string:
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


def collect(deltas: list[ParserDelta]) -> ParsedOutput:
    """Add up streamed deltas into the content and the complete calls."""
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.name is not None:
                names[call.index] = call.name
            arguments.setdefault(call.index, []).append(call.arguments)
    calls = tuple(ToolCall(names[i], "".join(arguments.get(i, []))) for i in sorted(names))
    return ParsedOutput("".join(d.content for d in deltas), calls, "".join(d.reasoning for d in deltas))


def merged(out: ParserDelta) -> ParserDelta:
    """Adjacent argument fragments of one call joined into one delta."""
    merged: list[ToolCallDelta] = []
    for delta in out.tool_calls:
        if merged and delta.name is None and merged[-1].index == delta.index:
            merged[-1] = replace(merged[-1], arguments=merged[-1].arguments + delta.arguments)
        elif delta.name is not None or delta.arguments:
            merged.append(delta)
    out.tool_calls = merged
    return out


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that starts `marker` (held back: the marker may follow)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
