"""Faults contained (issue #11): every failpoint, one victim and random rates, on a tiny real model.

After every scenario: every stream ended (per-test timeouts: a hang fails), the victim ended with an
error and nothing else did, the KV accounting is intact with every block free, the engine still
serves, and a greedy completion of a prompt used during the faults equals a fresh engine's (no
poisoned prefix cache).
"""

from __future__ import annotations

import asyncio

import pytest

from metrale import AsyncEngine, EngineConfig, RequestFailedError, SamplingParams
from metrale.failpoints import POINTS, InjectedFault
from tests.metrale.engine_helpers import assert_clean, collect, wait_idle

pytestmark = [pytest.mark.timeout(60), pytest.mark.both_loops]

PROMPTS = [[5 + i, 30 + i, 7, 60 - i, 11, 40 + 2 * i, 9, 50, 13, 70 - i, 21, 8 + i, 33, 44] for i in range(8)]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
STOPPING = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop=["~~"])  # stop_match runs; "~" is not in the tiny vocabulary


def config(model: str, failpoints: str = "") -> EngineConfig:
    return EngineConfig(model=model, kv_cache_bytes=2 << 20, block_size=4, max_num_seqs=16,
                        max_num_batched_tokens=128, failpoints=failpoints)


@pytest.fixture(scope="module")
def clean_outputs(tiny_model):
    """Greedy outputs of a fresh engine without failpoints."""
    async def run():
        async with AsyncEngine(config(tiny_model)) as engine:
            return await asyncio.gather(*(collect(engine.generate(p, STOPPING)) for p in PROMPTS))
    return asyncio.run(run())


async def check_recovered(engine: AsyncEngine, clean_outputs) -> None:
    await wait_idle(engine)
    assert_clean(engine)
    assert engine.health() == "serving"
    again = await collect(engine.generate(PROMPTS[0], STOPPING))
    assert again == clean_outputs[0]
    assert_clean(engine)


@pytest.mark.parametrize("point", [p for p in POINTS if p != "tokenize"])
async def test_a_fault_for_one_request_fails_it_alone(tiny_model, clean_outputs, point):
    async with AsyncEngine(config(tiny_model, f"{point}=@victim")) as engine:
        streams = [engine.generate(p, STOPPING, request_id="victim" if i == 3 else None)
                   for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        assert isinstance(results[3], RequestFailedError), results[3]
        assert isinstance(results[3].__cause__, InjectedFault) and results[3].__cause__.point == point
        assert [r for i, r in enumerate(results) if i != 3] == [c for i, c in enumerate(clean_outputs) if i != 3]
        await check_recovered(engine, clean_outputs)


async def test_a_tokenize_fault_refuses_that_submission_only(tiny_model, clean_outputs):
    async with AsyncEngine(config(tiny_model, "tokenize=1.0")) as engine:
        with pytest.raises(InjectedFault):
            engine.generate("hello", GREEDY)
        assert engine.stats().waiting == 0 and engine.health() == "serving"
        results = await asyncio.gather(*(collect(engine.generate(p, STOPPING)) for p in PROMPTS))  # ids: no tokenizing
        assert results == clean_outputs
        assert_clean(engine)


async def test_random_faults_at_every_point_end_every_stream(tiny_model, clean_outputs):
    spec = ",".join(f"{p}=0.03" for p in POINTS if p != "tokenize")
    async with AsyncEngine(config(tiny_model, spec)) as engine:
        streams = [engine.generate(PROMPTS[i % len(PROMPTS)], STOPPING) for i in range(120)]
        results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert all(isinstance(r, RequestFailedError) for r in failed), failed
        fired = sum(engine.failpoints_fired().values())
        assert fired > 0 and len(failed) <= fired  # no request fails without a fault to explain it
        for i, r in enumerate(results):
            if not isinstance(r, BaseException):
                assert r == clean_outputs[i % len(PROMPTS)]  # survivors are exact
        engine.disarm_failpoints()  # disarm, then check the engine recovered
        await check_recovered(engine, clean_outputs)
