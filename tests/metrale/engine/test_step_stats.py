"""StepStats on a tiny real engine: prompt tokens are whole prompts with the prefix-cache hits counted apart (vLLM's
prompt_tokens / prompt_tokens_cached), a request of n sequences is observed once in request_params_n with its
longest sequence, and every sequence is a finished request (as in vLLM)."""

from __future__ import annotations

import pytest
import pytest_asyncio

from metrale import AsyncEngine, EngineConfig, SamplingParams
from tests.metrale.engine_helpers import assert_clean, collect, wait_idle

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio(loop_scope="module")]
PROMPT = list(range(3, 40))  # 37 tokens: 9 full blocks of 4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model):
    config = EngineConfig(model=tiny_model, kv_cache_bytes=2 << 20, block_size=4, max_num_seqs=8,
                          max_num_batched_tokens=64)
    async with AsyncEngine(config) as eng:
        yield eng


def value(engine, name: str, **labels: str) -> float:
    return engine.metrics.registry.get_sample_value(name, {"model_name": engine.model_name, **labels}) or 0.0


async def test_a_repeated_prompt_counts_whole_with_its_cached_part(engine):
    before = {name: value(engine, name) for name in ("metrale_prompt_tokens_total",
                                                     "metrale_prompt_tokens_cached_total")}
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for _ in range(2):
        await collect(engine.generate(PROMPT, params))
    await wait_idle(engine)
    assert value(engine, "metrale_prompt_tokens_total") - before["metrale_prompt_tokens_total"] == 2 * len(PROMPT)
    cached = value(engine, "metrale_prompt_tokens_cached_total") - before["metrale_prompt_tokens_cached_total"]
    assert 0 < cached < len(PROMPT)  # the second run's full blocks, never the last token
    computed = value(engine, "metrale_prompt_tokens_by_source_total", source="local_compute")
    hit = value(engine, "metrale_prompt_tokens_by_source_total", source="local_cache_hit")
    assert computed + hit == value(engine, "metrale_prompt_tokens_total")
    assert hit == value(engine, "metrale_prompt_tokens_cached_total")
    assert_clean(engine)


async def test_n_sequences_are_one_request_in_params_n(engine):
    count = value(engine, "metrale_request_params_n_count")
    total = value(engine, "metrale_request_params_n_sum")
    finished = value(engine, "metrale_request_success_total", finished_reason="length")
    longest = value(engine, "metrale_request_max_num_generation_tokens_sum")
    stream = engine.generate([5, 6, 7, 8, 9], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=3,
                                                            ignore_eos=True))
    async for _ in stream:
        pass
    await wait_idle(engine)
    assert value(engine, "metrale_request_params_n_count") - count == 1
    assert value(engine, "metrale_request_params_n_sum") - total == 3
    assert value(engine, "metrale_request_max_num_generation_tokens_sum") - longest == 4
    assert value(engine, "metrale_request_success_total", finished_reason="length") - finished == 3
    assert value(engine, "metrale_request_params_max_tokens_count") >= 3
    assert value(engine, "metrale_request_time_per_output_token_seconds_count") >= 3
    assert_clean(engine)


async def test_max_tokens_param_is_the_effective_limit_and_embeddings_are_not_observed(engine):
    count = value(engine, "metrale_request_params_max_tokens_count")
    total = value(engine, "metrale_request_params_max_tokens_sum")
    unset = SamplingParams(temperature=0, stop_token_ids=[int(t) for t in range(512)])  # no max_tokens: the engine's
    await collect(engine.generate([5, 6, 7], unset))
    await engine.embed([[5, 6, 7, 8]])
    await wait_idle(engine)
    assert value(engine, "metrale_request_params_max_tokens_count") - count == 1  # the generation, not the embedding
    observed = value(engine, "metrale_request_params_max_tokens_sum") - total
    assert 4 < observed <= engine.max_model_len - 3  # the room the engine left it (not unset, not the embedding's 1)
    assert_clean(engine)
