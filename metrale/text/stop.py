"""Stop strings matched on the output text, across token and delta boundaries.

The matcher is fed text deltas (from the incremental detokenizer) and returns the part that is safe
to emit now. Anything that could still be the start of a stop string is held back, so no emitted
delta ever contains a piece of a stop string that later matches.

The rule, for any chunking of the same text: the output ends at the leftmost position where any stop
string occurs; at equal positions the shortest stop string wins (it completes first). A complete
match is only acted on once no earlier-starting, still-incomplete candidate remains:

    stops ("abcd", "b"), text so far "xab":  "b" is complete at 2, but "ab..." may become "abcd" at 1
    emit "x", hold "ab"; next "cd" -> match "abcd" at 1; next "q" instead -> match "b" at 2, emit "a"

At finish, `flush()` releases what is held (cut at a complete match inside it, if there is one).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Per-request stop-string state: the held-back tail and whether a stop string matched."""

    __slots__ = ("stop", "include_stop_str_in_output", "_held", "_matched", "_stop_str", "_closed")

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        """`stop`: non-empty strings (SamplingParams validates them). With include_stop_str_in_output
        the matched stop string is emitted at the end of the text; either way text after it is dropped."""
        self.stop: tuple[str, ...] = tuple(stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        self.include_stop_str_in_output = include_stop_str_in_output
        self._held = ""
        self._matched = False
        self._stop_str: str | None = None
        self._closed = False

    @property
    def matched(self) -> bool:
        """True once a stop string has matched; the request should finish with reason "stop"."""
        return self._matched

    @property
    def matched_stop(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop_str

    @property
    def held_text(self) -> str:
        """The text held back because it may still become (part of) a stop string."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        """Take the next text delta; return (text safe to emit now, whether a stop string matched).

        After a match nothing more may be fed (RuntimeError); the returned text ends before the stop
        string (or with it, when include_stop_str_in_output).
        """
        if self._matched or self._closed:
            raise RuntimeError("feed() after the stop matcher finished (matched or flushed)")
        if not self.stop:
            return delta, False
        text = self._held + delta
        match = _leftmost_match(text, self.stop)
        pending = _pending_start(text, self.stop, match[0] if match else len(text))
        if match is not None and pending is None:
            return self._finish(text, match), True
        cut = pending if pending is not None else len(text)
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """The request is finishing for another reason: release the held-back text.

        If the held text contains a complete stop string (one that was waiting on an earlier,
        longer candidate), the text is cut there and `matched` becomes True.
        """
        if self._matched or self._closed:
            return ""
        self._closed = True
        text, self._held = self._held, ""
        match = _leftmost_match(text, self.stop)
        return self._finish(text, match) if match is not None else text

    def _finish(self, text: str, match: tuple[int, str]) -> str:
        start, stop_str = match
        self._matched = True
        self._stop_str = stop_str
        self._held = ""
        return text[:start] + stop_str if self.include_stop_str_in_output else text[:start]


def _leftmost_match(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop) of the leftmost complete occurrence; the shortest stop at equal starts."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop)
        if index < 0:
            continue
        if best is None or index < best[0] or (index == best[0] and len(stop) < len(best[1])):
            best = (index, stop)
    return best


def _pending_start(text: str, stops: tuple[str, ...], before: int) -> int | None:
    """Leftmost j < before where text[j:] is a proper prefix of some stop string (it may still match)."""
    longest = max(len(s) for s in stops)
    for j in range(max(0, len(text) - longest + 1), min(before, len(text))):
        tail = text[j:]
        if any(len(s) > len(tail) and s.startswith(tail) for s in stops):
            return j
    return None
