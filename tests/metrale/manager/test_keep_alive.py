"""Ollama's keep_alive values as seconds."""

from __future__ import annotations

import math

import pytest

from metrale.manager.keep_alive import parse_keep_alive


@pytest.mark.parametrize(("value", "seconds"), [
    ("5m", 300.0), ("1h30m", 5400.0), ("10s", 10.0), ("250ms", 0.25), ("1.5h", 5400.0), ("300", 300.0),
    (300, 300.0), (2.5, 2.5), (0, 0.0), ("0", 0.0), ("0s", 0.0), (-1, math.inf), ("-1m", math.inf), ("-1", math.inf)])
def test_durations_and_seconds(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["5 minutes", "m", "", "5x", "1e400h", True, None, [5], float("nan"), "nan",
                                   1e12, "9" * 100])
def test_anything_else_is_refused(value):
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)
