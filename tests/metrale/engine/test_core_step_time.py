"""A long prompt does not stall running streams: EngineCore times each forward on an injected clock, the
scheduler learns the step cost from it and cuts the prompt's chunks to max_step_ms. The fake runner's
steps take made-up (clock) time: no wall-clock speed matters."""

from __future__ import annotations

import asyncio

import pytest

from metrale.engine.runner import StepInput
from metrale.sampling_params import SamplingParams
from scheduler.step_cost import StepWork
from tests.metrale.engine.fakes import FakeEngine, FakeRunner
from tests.metrale.engine_helpers import collect

pytestmark = pytest.mark.timeout(60)


class StepClock:
    """A clock that only the fake runner moves: each step costs fixed + per token + per attention pair."""

    def __init__(self) -> None:
        self.now = 0.0
        self.step_seconds: list[float] = []

    def __call__(self) -> float:
        return self.now

    def run(self, step: StepInput) -> None:
        work = StepWork()
        for s in step.scheduler_output.scheduled:
            work = work + StepWork.of_chunk(s.start_position, s.num_tokens)
        seconds = 0.002 + 0.0005 * work.num_tokens + 1e-7 * work.num_attention_pairs
        self.step_seconds.append(seconds)
        self.now += seconds


async def run_streams_and_long_prompt(**scheduling) -> tuple[FakeEngine, StepClock]:
    clock = StepClock()
    engine = FakeEngine(num_blocks=600, max_num_batched_tokens=64, max_model_len=1024,
                        runner=FakeRunner(before_step=clock.run), clock=clock, **scheduling)
    task = asyncio.create_task(engine.core.run_forever())
    try:
        params = SamplingParams(max_tokens=150, ignore_eos=True)
        streams = [engine.submit(f"s{i}", [i, i + 1, i + 2], params) for i in range(4)]
        for stream in streams:  # all four are decoding before the long prompt comes
            assert (await stream.__anext__()).token_ids
        long = engine.submit("long", [5] * 700, SamplingParams(max_tokens=1))
        results = await asyncio.gather(collect(long), *(collect(s) for s in streams))
        assert [finish for _, _, finish in results] == ["length"] * 5
        engine.check_clean()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        engine.close()
    return engine, clock


def long_prompt_steps(engine: FakeEngine) -> list[int]:
    """Indexes of the steps that computed a chunk of the long prompt."""
    return [i for i, step in enumerate(engine.runner.steps)
            if any(s.request_id == "long" for s in step.scheduler_output.scheduled)]


async def test_every_stream_gets_a_token_every_step_and_steps_keep_to_the_target():
    engine, clock = await run_streams_and_long_prompt(max_step_ms=20.0, min_prefill_chunk=8)
    chunked = long_prompt_steps(engine)
    for i in chunked:
        scheduled = {s.request_id: s for s in engine.runner.steps[i].scheduler_output.scheduled}
        assert all(len(scheduled[f"s{k}"].token_ids) == 1 and scheduled[f"s{k}"].samples for k in range(4))
    learned = chunked[2:]  # two probe chunks teach the cost model, then it is exact on this clock
    assert max(clock.step_seconds[i] for i in learned) <= 0.020 + 1e-9
    sizes = [len(s.token_ids) for i in learned for s in engine.runner.steps[i].scheduler_output.scheduled
             if s.request_id == "long"]
    assert max(sizes) > 16  # learned: more than the probes, and less than the 60 the tokens allow
    assert len(chunked) > 700 // 60


async def test_without_a_target_the_long_prompt_takes_the_budget_left_by_the_decodes():
    engine, clock = await run_streams_and_long_prompt()
    chunked = long_prompt_steps(engine)
    sizes = [len(s.token_ids) for i in chunked for s in engine.runner.steps[i].scheduler_output.scheduled
             if s.request_id == "long"]
    assert sizes[:-1] == [60] * (len(sizes) - 1)  # the streams still decode every step, in long steps
    assert max(clock.step_seconds[i] for i in chunked) > 0.020


async def test_under_a_relative_limit_chunk_steps_stay_within_twice_the_streams_decode_step():
    engine, clock = await run_streams_and_long_prompt(max_step_factor=2.0, min_prefill_chunk=1)
    chunked = long_prompt_steps(engine)
    for i in chunked:
        scheduled = engine.runner.steps[i].scheduler_output.scheduled
        assert all(any(s.request_id == f"s{k}" and len(s.token_ids) == 1 for s in scheduled) for k in range(4))
    learned = chunked[2:]  # two probe chunks teach the cost model, then it is exact on this clock
    for i in learned:
        decodes = StepWork()
        for s in engine.runner.steps[i].scheduler_output.scheduled:
            if s.request_id != "long":
                decodes = decodes + StepWork.of_chunk(s.start_position, s.num_tokens)
        decode_only = 0.002 + 0.0005 * decodes.num_tokens + 1e-7 * decodes.num_attention_pairs
        assert clock.step_seconds[i] <= 2 * decode_only + 1e-9
    sizes = [s.num_tokens for i in learned for s in engine.runner.steps[i].scheduler_output.scheduled
             if s.request_id == "long"]
    assert min(sizes) >= 1 and max(sizes) < 60  # cut, and still moving every step
