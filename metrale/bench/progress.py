"""A plain progress line on stderr (no dependency): redrawn in place on a terminal, one line every
few seconds otherwise (logs, CI)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`done(ok, tokens)` after each request; `close()` at the end prints the final line."""

    def __init__(self, total: int, label: str, *, stream: TextIO | None = None, enabled: bool = True,
                 every_s: float | None = None) -> None:
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.every_s = every_s if every_s is not None else (0.25 if self.tty else 10.0)
        self.start = time.perf_counter()
        self.finished = self.failed = self.tokens = 0
        self._last_draw = 0.0

    def done(self, ok: bool, tokens: int) -> None:
        """Count one finished request (ok False: failed or cancelled)."""
        self.finished += 1
        self.failed += 0 if ok else 1
        self.tokens += tokens
        now = time.perf_counter()
        if now - self._last_draw >= self.every_s:
            self._draw(now)

    def line(self, now: float | None = None) -> str:
        elapsed = (now or time.perf_counter()) - self.start
        width = 24
        filled = width * self.finished // max(1, self.total)
        bar = "#" * filled + "." * (width - filled)
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        return (f"[{self.label}] [{bar}] {self.finished}/{self.total} requests, {self.failed} not ok, "
                f"{self.tokens} tokens, {rate:.1f} tok/s, {elapsed:.0f} s")

    def _draw(self, now: float, final: bool = False) -> None:
        if not self.enabled:
            return
        self._last_draw = now
        if self.tty:
            self.stream.write("\r" + self.line(now) + ("\n" if final else ""))
        else:
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()

    def close(self) -> None:
        self._draw(time.perf_counter(), final=True)
