"""EngineCore's step loop on a fake runner: milliseconds per test, no model."""

from __future__ import annotations

import asyncio

import pytest

from metrale.errors import RequestFailedError
from metrale.sampling_params import SamplingParams
from tests.metrale.engine.fakes import EOS, FakeEngine
from tests.metrale.engine_helpers import collect

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
async def engine():
    fake = FakeEngine()
    task = asyncio.create_task(fake.core.run_forever())
    yield fake
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    fake.close()


async def test_requests_run_to_max_tokens_and_free_their_blocks(engine):
    streams = [engine.submit(f"r{i}", [i, i + 1, i + 2], SamplingParams(max_tokens=5)) for i in range(6)]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for i, (ids, text, finish) in enumerate(results):
        assert ids == [i + 3 + k for k in range(5)] and finish == "length"
        assert text == "".join(chr(97 + (i + 3 + k) % 26) for k in range(5))
    engine.check_clean()
    assert max(len(step.scheduler_output.scheduled) for step in engine.runner.steps) == 6  # one batch


async def test_eos_stops_and_is_not_text(engine):
    ids, text, finish = await collect(engine.submit("e", [EOS - 2], SamplingParams(max_tokens=10)))
    assert (ids, finish) == ([EOS - 1, EOS], "stop") and text == chr(97 + (EOS - 1) % 26)
    engine.check_clean()


async def test_stop_string_across_tokens_ends_the_request(engine):
    ids, text, finish = await collect(engine.submit("s", [0], SamplingParams(max_tokens=20, stop=["cde"])))
    assert text == "b" and finish == "stop" and len(ids) <= 5
    engine.check_clean()


async def test_abort_ends_with_abort_and_frees(engine):
    stream = engine.submit("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    first = await stream.__anext__()
    assert first.token_ids
    assert engine.core.abort("a") is True
    rest = [out async for out in stream]
    assert rest[-1].finish_reason == "abort"
    engine.check_clean()
    assert engine.core.abort("a") is False  # unknown once finished


async def test_a_transient_step_failure_fails_nobody(engine):
    def fail_once(step):
        engine.runner.before_step = None
        raise RuntimeError("boom")

    engine.runner.before_step = fail_once
    streams = [engine.submit(f"t{i}", [1, 2 + i], SamplingParams(max_tokens=3)) for i in range(4)]
    results = await asyncio.gather(*(collect(s) for s in streams))
    assert [finish for _, _, finish in results] == ["length"] * 4
    engine.check_clean()
    assert engine.core.dead is None


async def test_a_request_that_always_fails_fails_alone(engine):
    def fail_for_bad(step):
        if any(s.request_id == "bad" for s in step.scheduler_output.scheduled):
            raise RuntimeError("boom")

    engine.runner.before_step = fail_for_bad
    bad = engine.submit("bad", [1, 2], SamplingParams(max_tokens=3))
    good = [engine.submit(f"g{i}", [9, i], SamplingParams(max_tokens=3)) for i in range(5)]
    with pytest.raises(RequestFailedError, match="boom"):
        await collect(bad)
    results = await asyncio.gather(*(collect(s) for s in good))
    assert [finish for _, _, finish in results] == ["length"] * 5
    engine.check_clean()
    assert engine.core.dead is None
