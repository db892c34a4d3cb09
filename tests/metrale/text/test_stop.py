"""Stop strings: matched across token/delta boundaries, held back until decided, never leaked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.text.detokenizer import IncrementalDetokenizer
from metrale.text.stop import StopStringMatcher

from tests.metrale.text_helpers import encode, load_tokenizer


def reference(text: str, stops: tuple[str, ...], include: bool) -> tuple[str, bool]:
    """Cut at the leftmost occurrence of any stop string (the shortest one at equal positions)."""
    found = [(text.find(s), len(s), s) for s in stops if s in text]
    if not found:
        return text, False
    start, _, stop = min(found)
    return text[:start] + (stop if include else ""), True


def run(chunks: list[str], stops: tuple[str, ...], include: bool = False) -> tuple[list[str], bool]:
    """Feed chunks until a match; then flush if none matched. Returns the emitted pieces."""
    matcher = StopStringMatcher(stops, include)
    pieces = []
    for chunk in chunks:
        piece, matched = matcher.feed(chunk)
        pieces.append(piece)
        if matched:
            return pieces, True
    pieces.append(matcher.flush())
    return pieces, matcher.matched


def stream_through_tokenizer(text: str, stops: tuple[str, ...], include: bool = False):
    """Tokenize, then detokenize one token at a time into the matcher, as the engine does."""
    tokenizer = load_tokenizer()
    ids = encode(tokenizer, text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    chunks = [detokenizer.push([token_id]) for token_id in ids]
    chunks.append(detokenizer.flush())
    return ids, run(chunks, stops, include)


@pytest.mark.parametrize(("text", "stop", "expected"), [
    ("\n\nUser: hello there", "\n\nUser:", ""),  # at the start of the output
    ("The answer is 42.\n\nUser: and now?", "\n\nUser:", "The answer is 42."),  # in the middle
    ("Sure, here it is</answer>", "</answer>", "Sure, here it is"),  # at the very end
    ("Paris is the capital. ###END### trailing", "###END###", "Paris is the capital. "),
])
def test_stop_string_spanning_several_tokens(text, stop, expected):
    assert len(encode(load_tokenizer(), stop)) >= 2, "the stop string should span tokens"
    ids, (pieces, matched) = stream_through_tokenizer(text, (stop,))
    assert matched and "".join(pieces) == expected
    emitted = ""
    for piece in pieces:  # no piece ever shows a part of the stop string that then matched
        emitted += piece
        assert expected.startswith(emitted)
    _, (included, _) = stream_through_tokenizer(text, (stop,), include=True)
    assert "".join(included) == expected + stop


def test_held_back_tail_is_released_when_it_stops_matching():
    matcher = StopStringMatcher(("User:",))
    assert matcher.feed("Hello Us") == ("Hello ", False)
    assert matcher.held_text == "Us"
    assert matcher.feed("e") == ("", False)
    assert matcher.feed("ful") == ("Useful", False)
    assert matcher.feed(" Use") == (" ", False)
    assert matcher.flush() == "Use"  # finished for another reason: the tail is the model's text
    assert not matcher.matched


def test_overlapping_stop_strings_take_the_leftmost():
    pieces, matched = run(["xxab", "cabd"], ("abcab", "cabd"))
    assert matched and "".join(pieces) == "xx"
    pieces, matched = run(["aa", "a", "b!"], ("aab",))  # self-overlap: aaab contains aab at 1
    assert matched and "".join(pieces) == "a"
    pieces, matched = run(["xyz", "ab", "cd"], ("bc", "abcd"), include=True)
    assert matched and "".join(pieces) == "xyzabcd"


def test_stop_that_is_a_prefix_of_another():
    pieces, matched = run(["xa", "bc"], ("abc", "ab"))
    assert matched and "".join(pieces) == "x"
    matcher = StopStringMatcher(("ab", "abc"), include_stop_str_in_output=True)
    assert matcher.feed("xab") == ("xab", True) and matcher.matched_stop == "ab"


def test_shorter_complete_match_waits_for_an_earlier_longer_candidate():
    matcher = StopStringMatcher(("abcd", "b"))
    assert matcher.feed("xab") == ("x", False)  # "b" is complete, but "ab.." may become "abcd"
    assert matcher.feed("cd") == ("", True) and matcher.matched_stop == "abcd"
    matcher = StopStringMatcher(("abcd", "b"))
    matcher.feed("xab")
    assert matcher.feed("q") == ("a", True) and matcher.matched_stop == "b"
    matcher = StopStringMatcher(("abcd", "b"))
    matcher.feed("xab")
    assert matcher.flush() == "a" and matcher.matched  # finishing decides it


def test_misuse_and_passthrough():
    matcher = StopStringMatcher(("!",))
    assert matcher.feed("hi!") == ("hi", True)
    with pytest.raises(RuntimeError):
        matcher.feed("more")
    assert matcher.flush() == ""
    assert StopStringMatcher(()).feed("anything") == ("anything", False)
    with pytest.raises(ValueError):
        StopStringMatcher(("",))


ALPHABET = "abc d"


@settings(max_examples=300, deadline=None)
@given(text=st.text(ALPHABET, max_size=30),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3).map(tuple),
       cuts=st.lists(st.integers(0, 30), max_size=8), include=st.booleans())
def test_any_chunking_gives_the_reference_and_never_leaks(text, stops, cuts, include):
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(points, points[1:])]
    expected, expected_match = reference(text, stops, include)
    pieces, matched = run(chunks, stops, include)
    assert "".join(pieces) == expected and matched == expected_match
    cut_at, _ = reference(text, stops, False)
    before_match = "".join(pieces[:-1] if matched else pieces)
    assert len(before_match) <= len(cut_at), "emitted text past the stop position before the match"


def test_each_new_character_costs_one_automaton_step_whatever_the_number_of_stop_strings(monkeypatch):
    from metrale.sampling_params import MAX_STOP_STRINGS
    from metrale.text import stop as stop_module

    stops = tuple(f"never{i:04d}!" for i in range(MAX_STOP_STRINGS))
    steps = []
    real_step = stop_module.StopAutomaton.step
    monkeypatch.setattr(stop_module.StopAutomaton, "step", lambda self, state, char: steps.append(char) or
                        real_step(self, state, char))
    matcher = StopStringMatcher(stops)
    fed = 0
    for i in range(150):  # held-back text (here "never0") is never scanned again
        delta = " never0" if i % 2 else "12 ab"
        assert matcher.feed(delta)[1] is False
        fed += len(delta)
    assert len(steps) == fed
    assert matcher.feed("never0042!") == ("never0", True) and matcher.matched_stop == "never0042!"


def test_automata_are_compiled_once_per_tuple_of_stop_strings():
    from metrale.text.stop import compile_stops

    stops = ("a stop", "another")
    assert StopStringMatcher(stops)._automaton is StopStringMatcher(list(stops))._automaton is compile_stops(stops)
