"""EngineCore and the runner's per-request constraint state, on a scripted fake runner: a finished grammar
ends its request with "stop" at once, a failed constraint fails only its request, and every ended
request is named exactly once to the runner (StepInput.finished_request_ids) so it can drop its state."""

from __future__ import annotations

import asyncio
from collections import Counter

import msgspec
import pytest

from metrale.engine.runner import StepInput
from metrale.engine.step import RowError, RowResult
from metrale.errors import RequestFailedError
from metrale.sampling_params import SamplingParams
from tests.metrale.engine.fakes import FakeEngine, FakeRunner
from tests.metrale.engine_helpers import collect

pytestmark = pytest.mark.timeout(10)


class ScriptedRunner(FakeRunner):
    """FakeRunner whose 'grammars' finish after `stop_after[id]` output tokens or fail in `fail`."""

    def __init__(self) -> None:
        super().__init__()
        self.stop_after: dict[str, int] = {}
        self.fail: set[str] = set()

    def execute(self, step: StepInput) -> list[RowResult]:
        rows = super().execute(step)
        stopped = {row.request_id for row in step.sampling_rows
                   if len(row.output_token_ids) + 1 == self.stop_after.get(row.request_id)}
        return [msgspec.structs.replace(
            row, stopped=row.request_id in stopped,
            error=RowError.of(RuntimeError(f"grammar of {row.request_id} broke")) if row.request_id in self.fail else None)
            for row in rows]


@pytest.fixture
async def engine():
    fake = FakeEngine(runner=ScriptedRunner())
    task = asyncio.create_task(fake.core.run_forever())
    yield fake
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    fake.close()


async def test_a_finished_grammar_stops_now_even_with_ignore_eos(engine):
    engine.runner.stop_after = {"g": 3, "h": 1}
    params = SamplingParams(max_tokens=10, ignore_eos=True, min_tokens=5)
    (ids, text, finish), (ids_h, _, finish_h) = await asyncio.gather(
        collect(engine.submit("g", [0], params)), collect(engine.submit("h", [7], params)))
    assert (ids, text, finish) == ([1, 2, 3], "bcd", "stop")  # the last token is output, not hidden
    assert (ids_h, finish_h) == ([8], "stop")
    engine.check_clean()


async def test_a_failed_constraint_fails_only_its_request(engine):
    engine.runner.fail = {"bad"}
    bad = engine.submit("bad", [1], SamplingParams(max_tokens=5))
    good = engine.submit("good", [1], SamplingParams(max_tokens=5))
    with pytest.raises(RequestFailedError, match="grammar of bad broke"):
        await collect(bad)
    ids, _, finish = await collect(good)
    assert finish == "length" and ids == [2, 3, 4, 5, 6]
    engine.check_clean()
    assert engine.core.dead is None


async def test_every_ended_request_is_named_to_the_runner_once(engine):
    engine.runner.stop_after = {"stopped": 2}
    engine.runner.fail = {"failed"}
    streams = [engine.submit("length", [1], SamplingParams(max_tokens=3)),
               engine.submit("stopped", [1], SamplingParams(max_tokens=9)),
               engine.submit("failed", [1], SamplingParams(max_tokens=9)),
               engine.submit("aborted", [1], SamplingParams(max_tokens=50))]
    first = await streams[3].__anext__()
    assert first.token_ids and engine.core.abort("aborted")
    await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
    await collect(engine.submit("last", [1], SamplingParams(max_tokens=1)))  # one more step carries the ids
    named = Counter(i for step in engine.runner.steps for i in step.finished_request_ids)
    assert named == Counter({"length": 1, "stopped": 1, "failed": 1, "aborted": 1})
    engine.check_clean()
