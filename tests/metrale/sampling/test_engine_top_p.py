"""top_k / top_p rows through the whole engine on a tiny random model (flat logits: the nucleus holds most of
the vocabulary, the case that made the MLX path sort every row): concurrent seeded requests finish, reproduce
their tokens run after run, and free every KV block."""

from __future__ import annotations

import asyncio

import pytest

from metrale import AsyncEngine, EngineConfig, SamplingParams
from tests.metrale.engine_helpers import assert_clean, collect

pytestmark = [pytest.mark.timeout(90)]

PROMPT = [5, 30, 7, 60, 11, 40, 9, 50, 13]
PARAMS = [
    SamplingParams(max_tokens=10, top_p=0.9, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=10, top_p=0.95, temperature=1.5, seed=2, ignore_eos=True),
    SamplingParams(max_tokens=10, top_p=0.5, top_k=20, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=10, top_p=0.95, min_p=0.05, logprobs=5, seed=4, ignore_eos=True),
    SamplingParams(max_tokens=10, top_k=1, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
]


async def run_all(engine: AsyncEngine) -> list[tuple[list[int], str, str | None]]:
    return list(await asyncio.gather(*(collect(engine.generate(PROMPT, p)) for p in PARAMS)))


async def test_top_p_rows_finish_reproduce_and_free_every_block(tiny_model):
    config = EngineConfig(model=tiny_model, kv_cache_bytes=2 << 20, block_size=4, max_num_seqs=8)
    async with AsyncEngine(config) as engine:
        first = await run_all(engine)
        second = await run_all(engine)
        assert first == second  # seeded rows: the same tokens whatever the batch around them
        for (ids, _, finish), params in zip(first, PARAMS):
            assert finish == "length" and len(ids) == params.max_tokens
            assert all(0 <= t < 101 for t in ids)
        assert first[4][0] == first[5][0]  # top_k 1 is greedy
        assert len({tuple(ids) for ids, _, _ in first[:4]}) == 4
        assert_clean(engine)
