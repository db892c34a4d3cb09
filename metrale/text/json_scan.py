"""An incremental scanner of one JSON object's top level, character by character (for streamed tool calls).

    scanner = ObjectScanner()
    for char in text:                       # text as it streams in, split anywhere
        for event in scanner.push(char): ...
    ValueStart(key)          a top-level value begins
    ValueText(key, text)     more raw text of that value (exactly as generated; concatenated = the value)
    ValueEnd(key, raw)       the value is complete; raw is its whole text
    ObjectEnd()              the closing brace: the object is complete (push() must not be called again)
    ScanError(reason)        not a JSON object (push() must not be called again)

Only the structure is tracked (nesting, strings, escapes); values are not validated beyond that.
"""

from __future__ import annotations

from dataclasses import dataclass

_WHITESPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class ValueStart:
    key: str


@dataclass(frozen=True, slots=True)
class ValueText:
    key: str
    text: str


@dataclass(frozen=True, slots=True)
class ValueEnd:
    key: str
    raw: str


@dataclass(frozen=True, slots=True)
class ObjectEnd:
    pass


@dataclass(frozen=True, slots=True)
class ScanError:
    reason: str


Event = ValueStart | ValueText | ValueEnd | ObjectEnd | ScanError


class ObjectScanner:
    """Scans `{ "key": value, ... }`; see the module docstring for the events."""

    __slots__ = ("_mode", "_key", "_raw", "_depth", "_in_string", "_escape", "done")

    def __init__(self) -> None:
        self._mode = "open"  # open | first_key | key | in_key | colon | value | in_value | after_value
        self._key: list[str] = []
        self._raw: list[str] = []
        self._depth = 0  # nesting inside the current value
        self._in_string = False
        self._escape = False
        self.done = False  # ObjectEnd or ScanError was returned

    @property
    def key(self) -> str:
        return "".join(self._key)

    def push(self, char: str) -> list[Event]:
        """Take one character; return what it completed (see the module docstring)."""
        mode = self._mode
        if mode == "in_value":
            return self._value_char(char)
        if mode == "in_key":
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._mode = "colon"
                return []
            self._key.append(char)
            return []
        if char in _WHITESPACE:
            return []
        if mode == "open":
            return self._expect(char, "{", "first_key", "a JSON object must start with '{'")
        if mode in ("first_key", "key"):
            if char == "}" and mode == "first_key":  # {}
                return self._end()
            if char != '"':
                return self._error(f"expected a key, got {char!r}")
            self._key, self._mode = [], "in_key"
            return []
        if mode == "colon":
            return self._expect(char, ":", "value", f"expected ':' after key {self.key!r}")
        if mode == "value":
            self._mode, self._raw, self._depth, self._in_string = "in_value", [], 0, False
            return [ValueStart(self.key), *self._value_char(char)]
        # after_value
        if char == ",":
            self._mode = "key"  # a '}' right after ',' is an error
            return []
        if char == "}":
            return self._end()
        return self._error(f"expected ',' or '}}' after the value of {self.key!r}, got {char!r}")

    def _value_char(self, char: str) -> list[Event]:
        key = self.key
        if self._in_string:
            self._raw.append(char)
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if self._depth == 0:
                    return self._value_end([ValueText(key, char)])
            return [ValueText(key, char)]
        if self._depth == 0 and self._raw and (char in _WHITESPACE or char in ",}"):
            events = self._value_end([])  # a number or literal ends at what follows it
            return events + self.push(char)
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            if self._depth == 0:
                return self._error(f"unexpected {char!r} in the value of {key!r}")
            self._depth -= 1
            if self._depth == 0:
                self._raw.append(char)
                return self._value_end([ValueText(key, char)])
        self._raw.append(char)
        return [ValueText(key, char)]

    def _value_end(self, events: list[Event]) -> list[Event]:
        self._mode = "after_value"
        return [*events, ValueEnd(self.key, "".join(self._raw))]

    def _expect(self, char: str, wanted: str, next_mode: str, message: str) -> list[Event]:
        if char != wanted:
            return self._error(f"{message}, got {char!r}")
        self._mode = next_mode
        return []

    def _end(self) -> list[Event]:
        self.done = True
        return [ObjectEnd()]

    def _error(self, reason: str) -> list[Event]:
        self.done = True
        return [ScanError(reason)]
