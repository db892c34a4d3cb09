"""AsyncEngine end to end on the real default model, under asyncio and uvloop."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from metrale import AsyncEngine, EngineConfig, RequestFailedError, SamplingParams
from tests.metrale.engine_helpers import Runners, assert_clean, collect, wait_idle

pytestmark = [pytest.mark.real_model, pytest.mark.both_loops, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [
    "The capital of Italy is", "Once upon a time, in a small village,", "def fibonacci(n):",
    "The three primary colors are", "Water boils at", "My favourite book is",
    "To make a cup of tea, first", "The largest planet in the solar system is",
]


@pytest.fixture(scope="module")
def runners() -> Runners:
    return Runners()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(runners):
    config = EngineConfig(kv_cache_bytes=256 << 20, max_num_seqs=64, max_num_batched_tokens=512)
    async with AsyncEngine(config, runner_factory=runners) as eng:
        yield eng


async def test_chat_capital_of_france(engine):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids, text, finish = await collect(engine.chat(messages, SamplingParams(max_tokens=24, temperature=0)))
    assert "Paris" in text, text
    assert finish in ("stop", "length")
    assert_clean(engine)


async def test_batch_invariance_greedy(engine):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    alone = [(await engine.complete(p, params)).token_ids for p in PROMPTS]
    together = await asyncio.gather(*(engine.complete(p, params) for p in PROMPTS))
    assert [r.token_ids for r in together] == alone
    assert all(len(ids) == 32 for ids in alone)
    assert_clean(engine)


def finished_count(engine, reason: str) -> float:
    labels = {"model_name": engine.metrics.model_name, "finished_reason": reason}
    return engine.registry.get_sample_value("metrale_request_success_total", labels) or 0.0


async def test_forty_streams_ten_cancelled_four_ways(engine):
    max_tokens = 12
    aborts_before = finished_count(engine, "abort")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    streams = [engine.generate(PROMPTS[i % len(PROMPTS)] + f" ({i})", params) for i in range(40)]

    async def full(stream):
        return await collect(stream)

    async def by_aclose(stream):
        async for out in stream:
            await stream.aclose()
        return "aclose"

    async def by_abort(stream):
        async for out in stream:
            if out.token_ids:
                assert engine.abort(stream.request_id)
        return "abort"

    tasks = []
    for i, stream in enumerate(streams):
        kind = i % 4 if i < 10 else None
        if kind == 0:
            tasks.append(asyncio.create_task(by_aclose(stream)))
        elif kind == 1:
            tasks.append(asyncio.create_task(by_abort(stream)))
        elif kind == 2:
            tasks.append(asyncio.create_task(full(stream)))  # cancelled below, mid-stream
        elif kind == 3:
            tasks.append(asyncio.create_task(_break_after_one(stream)))
        else:
            tasks.append(asyncio.create_task(full(stream)))
    streams.clear()  # the break case must hold the only reference to its stream
    await asyncio.sleep(0)
    while engine.stats().num_steps < 3:
        await asyncio.sleep(0.01)
    for i in range(2, 10, 4):
        tasks[i].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for i in range(2, 10, 4):
        assert isinstance(results[i], asyncio.CancelledError)
    for ids, text, finish in results[10:]:
        assert len(ids) == max_tokens and finish == "length"
    await wait_idle(engine)
    # every one of the 10 ended as an abort (not by running to max_tokens), whichever way it ended
    assert finished_count(engine, "abort") - aborts_before == 10
    assert_clean(engine)


async def _break_after_one(stream):
    it = stream
    del stream
    async for out in it:
        break
    del it  # the stream is collected here, which aborts its request
    return "break"


async def test_transient_step_failure_fails_nobody_and_changes_no_token(engine, runners):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    clean = await asyncio.gather(*(collect(engine.generate(p, params)) for p in PROMPTS[:4]))
    calls = {"n": 0}

    def fail_the_second_step(step):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected forward failure")

    with runners.hooked(fail_the_second_step):
        results = await asyncio.gather(*(collect(engine.generate(p, params)) for p in PROMPTS[:4]))
    assert calls["n"] > 2 and results == clean  # the failed step was retried in halves
    await wait_idle(engine)
    assert_clean(engine)
    assert engine.health() == "serving"


async def test_deterministic_culprit_fails_alone_the_others_are_exact(engine, runners):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    clean = await asyncio.gather(*(collect(engine.generate(p, params)) for p in PROMPTS[:4]))

    def fail_the_culprit(step):
        if any(s.request_id == "culprit" for s in step.scheduler_output.scheduled):
            raise RuntimeError("injected forward failure")

    with runners.hooked(fail_the_culprit):
        streams = [engine.generate(p, params, request_id="culprit" if i == 1 else None)
                   for i, p in enumerate(PROMPTS[:4])]
        results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
    assert isinstance(results[1], RequestFailedError) and "injected forward failure" in str(results[1])
    assert [results[i] for i in (0, 2, 3)] == [clean[i] for i in (0, 2, 3)]
    await wait_idle(engine)
    assert_clean(engine)
    again = await collect(engine.generate(PROMPTS[1], params))  # its prompt's cached blocks were not poisoned
    assert again == clean[1]
    assert_clean(engine)


async def test_event_loop_ticks_during_long_prefill(engine):
    prompt = " ".join(f"word{i}" for i in range(600))  # several prefill chunks of max_num_batched_tokens
    steps_seen: list[int] = []  # the engine's step count at each tick: counted, not timed
    done = asyncio.Event()

    async def ticker():
        while not done.is_set():
            steps_seen.append(engine.stats().num_steps)
            await asyncio.sleep(0.005)

    first_step = engine.stats().num_steps
    task = asyncio.create_task(ticker())
    result = await engine.complete(prompt, SamplingParams(max_tokens=1, temperature=0))
    last_step = engine.stats().num_steps
    done.set()
    await task
    assert result.usage.prompt_tokens > 1000 and last_step - first_step >= 3
    # the loop ticked while chunks were computed, not only before the first and after the last
    during = set(steps_seen) & set(range(first_step, last_step))
    assert len(during) >= 2, (first_step, last_step, sorted(set(steps_seen)))
    assert_clean(engine)


async def test_bad_input_changes_nothing(engine):
    before = engine.stats()
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        engine.generate("", SamplingParams())
    with pytest.raises(ValueError):
        engine.generate([10**9], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len|exceed|long"):
        engine.generate("hi", SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError):
        engine.chat([{"role": "wizard", "content": "hi"}], SamplingParams())
    after = engine.stats()
    assert (after.running, after.waiting, after.kv_blocks_free) == (before.running, before.waiting, before.kv_blocks_free)
    assert_clean(engine)
