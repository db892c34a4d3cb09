"""One regression test per defect of issue #11, named after what it protects (tiny real model)."""

from __future__ import annotations

import asyncio
import functools
import gc
import threading

import pytest

from metrale import AsyncEngine, EngineConfig, EngineDeadError, RequestFailedError, SamplingParams
from metrale.engine import async_engine, core as core_module, submission
from metrale.engine.stream import RequestStream
from metrale.errors import PromptTooLongError
from tests.metrale.engine.fakes import EOS, FakeEngine
from tests.metrale.engine_helpers import Runners, assert_clean, collect, wait_idle

pytestmark = [pytest.mark.timeout(60), pytest.mark.both_loops]

PROMPT = [5, 30, 7, 60, 11, 40, 9, 50, 13, 70, 21, 8, 33, 44, 17, 19, 23]  # 17 tokens: 4 full blocks of 4
LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def config(model: str, **kw) -> EngineConfig:
    return EngineConfig(model=model, kv_cache_bytes=2 << 20, block_size=4, max_num_seqs=32,
                        max_num_batched_tokens=256, **kw)


async def wait_for(condition, timeout_s: float) -> None:
    """Poll `condition` until it holds; fail after `timeout_s` (generous: the machine may be busy)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, f"not true after {timeout_s} s"
        await asyncio.sleep(0.02)


def aborted(engine: AsyncEngine) -> float:
    return engine.registry.get_sample_value("metrale_request_success_total",
                                            {"model_name": engine.metrics.model_name, "finished_reason": "abort"}) or 0


async def test_an_output_fault_in_the_first_request_never_hangs_the_others(tiny_model):
    async with AsyncEngine(config(tiny_model, failpoints="stop_match=@first")) as engine:
        stopping = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop=["~~"])  # "~" is not in the tiny vocabulary
        first = engine.generate(PROMPT, stopping, request_id="first")
        others = [engine.generate([3 + i] + PROMPT[1:], stopping) for i in range(20)]
        with pytest.raises(RequestFailedError):
            await collect(first)
        results = await asyncio.gather(*(collect(s) for s in others))
        assert all(finish == "length" for _, _, finish in results)
        await wait_idle(engine)
        assert_clean(engine)


class BrokenText:
    """A request's text front-end whose final flush raises (the request is never stepped)."""

    def push(self, token_ids, final):
        raise AssertionError("the request was never meant to be stepped")

    def flush(self):
        raise UnicodeError("flush broke")


async def test_ending_every_stream_survives_a_final_delta_that_raises():
    fake = FakeEngine(num_blocks=256, block_size=4)
    try:
        channel = fake.core.submit("broken", [3, 5, 7], LONG, BrokenText(), eos_token_ids=(EOS,),
                                   max_tokens=LONG.max_tokens)
        streams = [RequestStream(channel, functools.partial(fake.core.abort, channel=channel))]
        streams += [fake.submit(f"other-{i}", [4 + i, 5, 6, 7], LONG) for i in range(5)]  # queued, not yet stepped
        fake.core.die(RuntimeError("simulated engine fault"))
        for stream in streams:
            with pytest.raises(RequestFailedError, match="simulated engine fault"):
                await collect(stream)
        assert fake.core.dead is not None
        fake.check_clean()
    finally:
        fake.close()


async def test_an_engine_that_keeps_failing_dies_ends_every_stream_and_refuses_new_requests(tiny_model):
    runners = Runners()
    async with AsyncEngine(config(tiny_model), runner_factory=runners) as engine:
        def always_fails(step):
            raise RuntimeError("the model cannot run at all")
        runners.runner.hook = always_fails
        for attempt in range(core_module.FATAL_FAILED_STEPS):
            with pytest.raises(RequestFailedError):
                await collect(engine.generate([attempt + 3] + PROMPT, GREEDY))
        assert await asyncio.wait_for(engine.wait_until_dead(), 10) is not None
        assert engine.health() == "unhealthy"
        with pytest.raises(EngineDeadError):
            engine.generate(PROMPT, GREEDY)
        stats = engine.stats()
        assert stats.running == stats.waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert engine.health() == "stopped"  # shutdown after death returned and left nothing running


async def test_an_abort_during_a_failed_step_does_not_poison_the_prefix_cache(tiny_model):
    runners = Runners()
    async with AsyncEngine(config(tiny_model), runner_factory=runners) as engine:
        clean = await collect(engine.generate(PROMPT, GREEDY))
        await wait_idle(engine)  # the clean run's blocks stay cached, evictable

        def abort_then_fail(step):
            if any(s.request_id == "victim" for s in step.scheduler_output.scheduled):
                engine.abort("victim")  # from the MLX thread: lands while the step is in flight
                raise RuntimeError("forward failed")

        victim_prompt = [99] + PROMPT  # its own blocks: hashed at schedule time, never written
        with runners.hooked(abort_then_fail):
            _, _, finish = await collect(engine.generate(victim_prompt, GREEDY, request_id="victim"))
        assert finish == "abort"
        hits_before = engine.stats().prefix_cache_hits
        again = await collect(engine.generate(victim_prompt, GREEDY))
        assert engine.stats().prefix_cache_hits == hits_before  # nothing of the failed step was reused
        fresh = await collect(engine.generate(PROMPT, GREEDY))
        assert fresh == clean and again[2] == "length"
        await wait_idle(engine)
        assert_clean(engine)


async def test_one_failing_request_does_not_fail_its_batch(tiny_model):
    async with AsyncEngine(config(tiny_model, failpoints="sample=@bad")) as engine:
        streams = [engine.generate([3 + i] + PROMPT, GREEDY, request_id="bad" if i == 7 else None) for i in range(20)]
        results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        assert isinstance(results[7], RequestFailedError)
        assert sum(isinstance(r, BaseException) for r in results) == 1
        await wait_idle(engine)
        assert_clean(engine)


async def test_a_request_without_max_tokens_uses_the_rest_of_the_context(tiny_model):
    async with AsyncEngine(config(tiny_model, max_model_len=40)) as engine:
        ids, _, finish = await collect(engine.generate(PROMPT, SamplingParams(max_tokens=None, ignore_eos=True)))
        assert finish == "length" and len(ids) == 40 - len(PROMPT)
        with pytest.raises(PromptTooLongError):
            engine.generate(list(range(3, 43)), SamplingParams(max_tokens=None))
        assert_clean(engine)


async def test_an_oversized_prompt_is_refused_before_tokenizing(tiny_model, monkeypatch):
    async with AsyncEngine(config(tiny_model, max_model_len=256)) as engine:
        calls = []
        real_encode = engine.tokenizer.encode
        monkeypatch.setattr(engine.tokenizer, "encode",
                            lambda *a, **k: calls.append(threading.current_thread().name) or real_encode(*a, **k))
        with pytest.raises(PromptTooLongError, match="characters"):
            await engine.prompt_token_ids("ab" * 1_000_000)
        with pytest.raises(PromptTooLongError):
            engine.generate("ab" * 1_000_000, GREEDY)
        assert calls == []  # refused without tokenizing
        monkeypatch.setattr(submission, "OFF_LOOP_PROMPT_CHARS", 100)
        ids = await engine.prompt_token_ids("ab " * 60)
        assert [c.rsplit("_", 1)[0] for c in calls] == ["metrale-tokenize"] and ids  # a long prompt is tokenized off the event loop


async def test_breaking_out_of_async_for_aborts_while_the_stream_is_still_referenced(tiny_model):
    async with AsyncEngine(config(tiny_model)) as engine:
        before = aborted(engine)
        stream = engine.generate(PROMPT, LONG)
        async for _ in stream:
            break
        await wait_idle(engine)
        assert aborted(engine) == before + 1 and stream is not None
        assert_clean(engine)


async def test_an_exception_in_the_consumer_aborts_even_when_it_is_kept(tiny_model):
    async with AsyncEngine(config(tiny_model)) as engine:
        before = aborted(engine)
        stream = engine.generate(PROMPT, LONG)
        kept = None
        try:
            async for _ in stream:
                raise ValueError("consumer bug")
        except ValueError as error:
            kept = error
        await wait_idle(engine)
        assert aborted(engine) == before + 1 and kept is not None
        assert_clean(engine)


async def test_a_stale_stream_never_aborts_a_newer_request_with_its_id(tiny_model):
    async with AsyncEngine(config(tiny_model)) as engine:
        old = engine.generate(PROMPT, GREEDY, request_id="same")
        first = await old.__anext__()  # read by hand: not finished, never closed
        assert first.token_ids
        await wait_idle(engine)  # it ran to its end meanwhile
        new = engine.generate(PROMPT, LONG, request_id="same")
        await old.aclose()
        del old
        gc.collect()
        ids, _, finish = await collect(new)
        assert finish == "length" and len(ids) == LONG.max_tokens
        assert_clean(engine)


async def test_the_running_gauge_counts_a_request_the_moment_it_is_queued(tiny_model):
    async with AsyncEngine(config(tiny_model)) as engine:
        stream = engine.generate(PROMPT, GREEDY)
        gauge = engine.registry.get_sample_value("metrale_requests_waiting", {"model_name": engine.metrics.model_name})
        assert gauge == 1
        await collect(stream)
        assert_clean(engine)


async def test_the_step_watchdog_marks_a_stuck_step_unhealthy_until_it_ends(tiny_model, monkeypatch):
    runners = Runners()
    async with AsyncEngine(config(tiny_model), runner_factory=runners) as engine:
        await collect(engine.generate(PROMPT, GREEDY))  # a few normal steps set the expected step time
        monkeypatch.setattr(async_engine, "WATCHDOG_MIN_S", 0.3)
        monkeypatch.setattr(async_engine, "WATCHDOG_FACTOR", 0.0)  # the threshold is 0.3 s however slow the machine
        entered, release = threading.Event(), threading.Event()

        def stuck(step):
            entered.set()
            release.wait(100)

        runners.runner.hook = stuck
        stream = engine.generate(PROMPT, GREEDY)
        assert await asyncio.to_thread(entered.wait, 30)
        await wait_for(lambda: engine.health() == "unhealthy", 30)  # the step stays stuck until released
        release.set()
        assert (await collect(stream))[2] == "length"
        assert engine.health() == "serving"
        assert_clean(engine)
