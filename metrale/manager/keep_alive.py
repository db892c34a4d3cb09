"""Ollama's keep_alive: how long a model stays resident after a request, as seconds.

    "5m", "1h30m", "10s", "250ms", "-1m"   a Go-style duration string (units h, m, s, ms, us, ns)
    300, 2.5, "300"                       seconds
    0                                     unload once the request ends
    any negative value                    keep it forever (math.inf)
"""

from __future__ import annotations

import math
import re

MAX_KEEP_ALIVE_S = 10 * 365 * 24 * 3600.0  # longer finite values are refused: a client means "forever" by -1
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|m|s|us|µs|ns)")
_MAX_CHARS = 64


def parse_keep_alive(value: object) -> float:
    """Seconds a model stays resident after a request (math.inf for a negative value); ValueError naming the
    problem for anything else (a bool, an unknown unit, NaN, more than MAX_KEEP_ALIVE_S)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"keep_alive must be a duration string or a number of seconds, not {value!r}")
    seconds = _seconds(value.strip()) if isinstance(value, str) else float(value)
    if math.isnan(seconds):
        raise ValueError("keep_alive must be a number of seconds, not NaN")
    if seconds < 0:
        return math.inf
    if seconds > MAX_KEEP_ALIVE_S:
        raise ValueError(f"keep_alive {value!r} is longer than {MAX_KEEP_ALIVE_S:.0f} s; use -1 to keep it forever")
    return seconds


def _seconds(text: str) -> float:
    if len(text) > _MAX_CHARS:
        raise ValueError(f"keep_alive is longer than {_MAX_CHARS} characters")
    try:
        return float(text)
    except ValueError:
        pass
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    parts = _PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise ValueError(f"keep_alive {text!r} is not a duration such as \"5m\", \"1h30m\", \"10s\" or a number "
                         "of seconds")
    return sign * sum(float(number) * _UNITS[unit] for number, unit in parts)
