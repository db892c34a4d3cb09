"""The engine in its own process (EngineConfig(engine_process=True)) and in-process, same tests: the same
outputs, the same typed rejections and contained faults; and what only a process can do: a child killed
by SIGSEGV or SIGKILL ends the requests in flight with an error, new requests get EngineRestartingError
while a new child starts with the same config, and a spent restart budget is final."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from metrale import AsyncEngine, EngineConfig, RequestFailedError, SamplingParams
from metrale.errors import (DuplicateRequestError, EngineDeadError, EngineRestartingError, InvalidParamsError,
                            PromptTooLongError)
from metrale.failpoints import InjectedFault
from metrale.server.app import ServerApp
from metrale.settings import RuntimeSettings
from tests.server.fakes import call
from tests.metrale.engine_helpers import assert_clean, collect, wait_idle

pytestmark = [pytest.mark.timeout(120)]

PROMPTS = [[5 + i, 30 + i, 7, 60 - i, 11, 40 + 2 * i, 9, 50, 13, 70 - i, 21, 8 + i] for i in range(6)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
STOPPING = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=["~~"], logprobs=2)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
MODES = [pytest.param(False, id="in-process"), pytest.param(True, id="engine-process")]


def config(model: str, engine_process: bool, **kw) -> EngineConfig:
    kw = {"kv_cache_bytes": 2 << 20, "block_size": 4, "max_num_seqs": 16, "max_num_batched_tokens": 128,
          "max_model_len": 512, **kw}
    return EngineConfig(model=model, engine_process=engine_process, **kw)


async def outputs_of(engine: AsyncEngine) -> list:
    streams = [engine.generate(p, STOPPING if i % 2 else GREEDY) for i, p in enumerate(PROMPTS)]
    group = engine.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=2))
    results = await asyncio.gather(*(collect(s) for s in streams))
    seen = {}
    async for out in group:
        seen.setdefault(out.index, []).extend(out.token_ids)
    return [results, seen]


@pytest.fixture(scope="module")
def in_process_outputs(tiny_model):
    async def run():
        async with AsyncEngine(config(tiny_model, False)) as engine:
            return await outputs_of(engine)
    return asyncio.run(run())


@pytest.mark.parametrize("engine_process", MODES)
async def test_the_same_outputs_in_both_modes(tiny_model, in_process_outputs, engine_process):
    async with AsyncEngine(config(tiny_model, engine_process)) as engine:
        assert await outputs_of(engine) == in_process_outputs
        await wait_idle(engine)
        assert_clean(engine)
        assert engine.stats().requests_finished == len(PROMPTS) + 2


@pytest.mark.parametrize("engine_process", MODES)
async def test_rejections_are_typed_and_change_nothing(tiny_model, engine_process):
    async with AsyncEngine(config(tiny_model, engine_process)) as engine:
        with pytest.raises(PromptTooLongError):
            engine.generate(PROMPTS[0], SamplingParams(max_tokens=600))
        with pytest.raises(InvalidParamsError):
            engine.generate(PROMPTS[0], SamplingParams(max_tokens=4, n=17))  # more sequences than max_num_seqs
        first = engine.generate(PROMPTS[0], LONG, request_id="dup")
        with pytest.raises(DuplicateRequestError):
            engine.generate(PROMPTS[1], GREEDY, request_id="dup")
        await first.aclose()  # aborts it
        await wait_idle(engine)
        assert_clean(engine)
        assert (await collect(engine.generate(PROMPTS[1], GREEDY)))[2] == "length"


@pytest.mark.parametrize("engine_process", MODES)
async def test_a_fault_in_a_step_fails_its_request_alone(tiny_model, engine_process):
    async with AsyncEngine(config(tiny_model, engine_process, failpoints="execute=@victim")) as engine:
        streams = [engine.generate(p, GREEDY, request_id="victim" if i == 2 else None) for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        assert isinstance(results[2], RequestFailedError)
        assert isinstance(results[2].__cause__, InjectedFault) and results[2].__cause__.point == "execute"
        assert all(r[2] == "length" for i, r in enumerate(results) if i != 2)
        await wait_idle(engine)
        assert_clean(engine)


@pytest.mark.parametrize("engine_process", MODES)
async def test_a_stop_string_found_by_the_front_end_ends_the_request_in_the_engine(tiny_model, engine_process):
    async with AsyncEngine(config(tiny_model, engine_process)) as engine:
        ids, text, _ = await collect(engine.generate(PROMPTS[3], SamplingParams(max_tokens=40, temperature=0,
                                                                                 ignore_eos=True)))
        stop = text[len(text) // 2:len(text) // 2 + 2]  # met halfway through the greedy output
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
        stopped_ids, stopped_text, finish = await collect(engine.generate(PROMPTS[3], params))
        assert finish == "stop" and stopped_text == text[:text.index(stop)]
        assert stopped_ids == ids[:len(stopped_ids)] and len(stopped_ids) < len(ids)
        await wait_idle(engine)  # the engine ended it (its blocks are free), not just the stream
        assert_clean(engine)


async def streams_under_way(engine: AsyncEngine, count: int) -> list:
    """`count` long streams, each past its first token."""
    streams = [engine.generate(PROMPTS[i % len(PROMPTS)], LONG) for i in range(count)]
    for stream in streams:
        await stream.__anext__()
    return streams


async def ends_with_an_error(stream) -> BaseException:
    with pytest.raises(RequestFailedError) as failure:
        async for _ in stream:
            pass
    return failure.value


def hold_restarts(client) -> asyncio.Event:
    """Make the client's restart wait for the returned event: the restarting state is observed, not raced."""
    gate = asyncio.Event()
    spawn = client._spawn

    async def gated_spawn():
        await gate.wait()
        return await spawn()

    client._spawn = gated_spawn
    return gate


@pytest.mark.parametrize("signum", [signal.SIGSEGV, signal.SIGKILL])
async def test_a_killed_engine_process_fails_what_was_in_flight_and_comes_back(tiny_model, signum):
    async with AsyncEngine(config(tiny_model, True)) as engine:
        client = engine._client
        gate = hold_restarts(client)
        before = engine.generate(PROMPTS[0], GREEDY)
        streams = await streams_under_way(engine, 4)
        old_pid = client._proc.pid
        os.kill(old_pid, signum)
        errors = [await ends_with_an_error(stream) for stream in streams]
        assert all("the engine process died" in str(error) and signal.Signals(signum).name in str(error)
                   for error in errors), errors
        assert engine.health() == "restarting"
        with pytest.raises(EngineRestartingError):
            engine.generate(PROMPTS[1], GREEDY)
        gate.set()
        while engine.health() != "serving":
            await asyncio.sleep(0.05)
        assert client._proc.pid != old_pid
        assert (await collect(engine.generate(PROMPTS[1], GREEDY)))[2] == "length"
        assert 'metrale_engine_restarts_total{model_name="tiny"} 1.0' in engine.metrics_exposition().decode()
        await wait_idle(engine)
        assert_clean(engine)
        assert before.request_id  # it ended one way or the other; nothing hangs


async def test_a_hung_engine_process_is_killed_failing_what_was_in_flight_and_comes_back(tiny_model):
    settings = RuntimeSettings.resolve(environ={}).replace(engine_hang_timeout_s=2.0)
    async with AsyncEngine(config(tiny_model, True), settings=settings) as engine:
        client = engine._client
        gate = hold_restarts(client)
        streams = await streams_under_way(engine, 3)
        old_pid = client._proc.pid
        os.kill(old_pid, signal.SIGSTOP)  # alive, answering nothing: as if stuck in a native call
        try:
            errors = [await asyncio.wait_for(ends_with_an_error(stream), 60) for stream in streams]
            health = engine.health()
            response = await call(ServerApp(engine, manage_engine=False), "GET", "/health")
            exposition = engine.metrics_exposition().decode()
        finally:
            gate.set()  # the test never hangs on its own gate
        assert all("the engine process died (hung: no heartbeat" in str(error) for error in errors), errors
        assert health == "restarting"
        assert response.status == 503 and response.json() == {"status": "restarting"}
        assert 'metrale_engine_hangs_total{model_name="tiny"} 1.0' in exposition
        while engine.health() != "serving":
            await asyncio.sleep(0.05)
        assert client._proc.pid != old_pid
        assert (await collect(engine.generate(PROMPTS[1], GREEDY)))[2] == "length"
        assert 'metrale_engine_restarts_total{model_name="tiny"} 1.0' in engine.metrics_exposition().decode()
        await wait_idle(engine)
        assert_clean(engine)
    with pytest.raises(ProcessLookupError):
        os.kill(old_pid, 0)  # killed and reaped, not left stopped


async def test_a_step_stuck_in_the_engine_process_is_killed_while_its_loop_still_beats(tiny_model):
    settings = RuntimeSettings.resolve(environ={}).replace(engine_hang_timeout_s=2.0)
    hung = config(tiny_model, True, failpoints="execute=hang@victim")  # the MLX thread blocks in that step
    async with AsyncEngine(hung, settings=settings) as engine:
        client = engine._client
        old_pid = client._proc.pid
        streams = await streams_under_way(engine, 2)
        victim = engine.generate(PROMPTS[2], GREEDY, request_id="victim")
        errors = [await asyncio.wait_for(ends_with_an_error(s), 60) for s in (*streams, victim)]
        assert all("the engine process died (hung: a step has run for" in str(error) for error in errors), errors
        assert 'metrale_engine_hangs_total{model_name="tiny"} 1.0' in engine.metrics_exposition().decode()
        while engine.health() != "serving":
            await asyncio.sleep(0.05)
        assert client._proc.pid != old_pid
        assert (await collect(engine.generate(PROMPTS[1], GREEDY)))[2] == "length"
        await wait_idle(engine)
        assert_clean(engine)


async def test_a_spent_restart_budget_is_final(tiny_model):
    async with AsyncEngine(config(tiny_model, True, max_engine_restarts=0)) as engine:
        (stream,) = await streams_under_way(engine, 1)
        os.kill(engine._client._proc.pid, signal.SIGKILL)
        await ends_with_an_error(stream)
        error = await asyncio.wait_for(engine.wait_until_dead(), 60)
        assert isinstance(error, EngineDeadError) and "restart budget" in str(error)
        assert engine.health() == "unhealthy"
        with pytest.raises(EngineDeadError):
            engine.generate(PROMPTS[0], GREEDY)


def test_the_blocking_llm_runs_an_engine_process_too(tiny_model, in_process_outputs):
    from metrale import LLM

    with LLM(config(tiny_model, True)) as llm:
        results = llm.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results[::2]] == [ids for ids, _, _ in in_process_outputs[0][::2]]
