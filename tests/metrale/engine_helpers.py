"""Shared pieces of the engine tests: a real-model engine per test module, under each event loop."""

from __future__ import annotations

import asyncio

import pytest

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
    while engine.stats().running or engine.stats().waiting or engine.num_unfinished:
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
