"""Shared pieces of the engine tests: a real-model engine per test module, under each event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

import pytest

from metrale.engine.runner import ModelRunner
from metrale.engine.startup import RunnerKeeper

def assert_clean(engine) -> None:
    """The KV integrity check: nothing running or waiting, every block free, accounting consistent."""
    engine.check_integrity()
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0, stats
    assert stats.kv_blocks_free == stats.kv_blocks_total, stats


async def wait_idle(engine, timeout_s: float = 30.0) -> None:
    """Wait until the engine has finished every request (aborts land at a step boundary)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (stats := engine.stats()).running or stats.waiting or stats.requests_unfinished:
        if loop.time() > deadline:
            pytest.fail(f"engine not idle after {timeout_s} s: {engine.stats()}")
        await asyncio.sleep(0.01)


async def collect(stream) -> tuple[list[int], str, str | None]:
    """(token ids, text, finish_reason) of a whole stream."""
    ids, text, finish = [], [], None
    async for out in stream:
        ids.extend(out.token_ids)
        text.append(out.text)
        finish = out.finish_reason
    return ids, "".join(text), finish


class HookedRunner(ModelRunner):
    """The real runner; `hook(step)`, when set, runs first in each step on the MLX thread: raise there
    to fail the step, wait there to hold it."""

    hook: Callable[[object], None] | None = None

    def execute(self, step):
        hook = self.hook
        if hook is not None:
            hook(step)
        return super().execute(step)


class Runners(RunnerKeeper):
    """A runner factory for AsyncEngine / LLM(runner_factory=...) that builds HookedRunners and keeps the last
    one (`runner`), so that tests reach the runner here and never through the engine."""

    def __init__(self) -> None:
        super().__init__(HookedRunner.from_loaded)

    @contextlib.contextmanager
    def hooked(self, hook: Callable[[object], None]) -> Iterator[HookedRunner]:
        """Run `hook` before every step of the runner until the block ends."""
        runner = self.runner
        runner.hook = hook
        try:
            yield runner
        finally:
            runner.hook = None
