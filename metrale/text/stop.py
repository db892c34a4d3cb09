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

Cost: the stop strings are compiled once into an Aho-Corasick automaton (cached by the tuple of
strings, shared read-only), and each delta costs one automaton step per new character, whatever the
number of stop strings: the text already seen is never scanned again.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence

AUTOMATON_CACHE_SIZE = 64  # distinct stop-string tuples kept compiled


class StopAutomaton:
    """Aho-Corasick over a set of stop strings. State 0 is the root (nothing pending).

    For each state (a prefix of some stop string, reached by the longest suffix of the text so far):
        match_length[s]   the longest stop string that ends here (0: none)
        pending_depth[s]  the longest suffix still a proper prefix of a stop string, which may complete
                          later (0: none); the text from there on must be held back
    """

    __slots__ = ("longest", "_goto", "_fail", "match_length", "pending_depth")

    def __init__(self, stops: Sequence[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal = [False]
        for stop in stops:
            state = 0
            for char in stop:
                following = goto[state].get(char)
                if following is None:
                    following = len(goto)
                    goto[state][char] = following
                    goto.append({})
                    depth.append(depth[state] + 1)
                    terminal.append(False)
                state = following
            terminal[state] = True
        fail = [0] * len(goto)
        match_length = [0] * len(goto)
        pending_depth = [0] * len(goto)
        queue = deque([0])
        while queue:  # breadth first: a state's failure state is shallower, so already complete
            state = queue.popleft()
            match_length[state] = depth[state] if terminal[state] else match_length[fail[state]]
            pending_depth[state] = depth[state] if goto[state] else pending_depth[fail[state]]
            for char, child in goto[state].items():
                if state:
                    fallback = fail[state]
                    while fallback and char not in goto[fallback]:
                        fallback = fail[fallback]
                    fail[child] = goto[fallback].get(char, 0)
                queue.append(child)
        self.longest = max((len(s) for s in stops), default=0)
        self._goto = goto
        self._fail = fail
        self.match_length = match_length
        self.pending_depth = pending_depth

    def step(self, state: int, char: str) -> int:
        """The state after `char` (amortized O(1))."""
        goto, fail = self._goto, self._fail
        while state and char not in goto[state]:
            state = fail[state]
        return goto[state].get(char, 0)


@functools.lru_cache(maxsize=AUTOMATON_CACHE_SIZE)
def compile_stops(stops: tuple[str, ...]) -> StopAutomaton:
    """The (shared, cached) automaton of `stops`."""
    return StopAutomaton(stops)


class StopStringMatcher:
    """Per-request stop-string state: the automaton's state, the held-back tail and the match."""

    __slots__ = ("stop", "include_stop_str_in_output", "_automaton", "_state", "_held", "_held_start",
                 "_best", "_matched", "_stop_str", "_closed")

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        """`stop`: non-empty strings (SamplingParams validates and bounds them). With
        include_stop_str_in_output the matched stop string is emitted at the end of the text; either
        way text after it is dropped."""
        self.stop: tuple[str, ...] = tuple(stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r:.200}")
        self.include_stop_str_in_output = include_stop_str_in_output
        self._automaton = compile_stops(self.stop) if self.stop else None
        self._state = 0
        self._held = ""
        self._held_start = 0  # the held text's offset in the whole output text
        self._best: tuple[int, int] | None = None  # (offset, length) of the leftmost complete match seen
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
        automaton = self._automaton
        if automaton is None:
            return delta, False
        text = self._held + delta
        base = self._held_start
        state, best = self._state, self._best
        end = base + len(self._held)  # offset just past the character stepped
        for char in delta:
            state = automaton.step(state, char)
            end += 1
            length = automaton.match_length[state]
            if length and (best is None or end - length < best[0]):
                best = (end - length, length)  # a longer match ending here starts earlier
            if best is not None and end - automaton.pending_depth[state] >= best[0]:
                return self._finish(text, best[0] - base, best[1]), True  # no earlier candidate pending
        self._state, self._best = state, best
        cut = end - automaton.pending_depth[state] - base
        self._held, self._held_start = text[cut:], base + cut
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
        if self._best is not None:
            return self._finish(text, self._best[0] - self._held_start, self._best[1])
        return text

    def _finish(self, text: str, start: int, length: int) -> str:
        stop_str = text[start:start + length]
        self._matched = True
        self._stop_str = stop_str
        self._held = ""
        return text[:start] + stop_str if self.include_stop_str_in_output else text[:start]
