"""AsyncEngine with tensor_parallel_size=2 (the engine is rank 0 of a real two-process ring): greedy
tokens equal TP=1's token for token, with concurrent requests, an abort and preemptions; a rank that
dies or hangs fails every open request with an error and leaves the engine unhealthy, never hung."""

from __future__ import annotations

import asyncio

import pytest

from metrale import AsyncEngine, EngineConfig, SamplingParams
from tests.distributed.conftest import run_driver
from tests.distributed.driver import FORK_PROMPT
from tests.metrale.engine_helpers import assert_clean, collect
from tests.metrale.model_helpers import write_tiny_model

pytestmark = pytest.mark.distributed
BLOCKS = 40  # of 4 tokens: too few for six 44-token requests at once, so some are preempted
TP1_BLOCK_BYTES = 1024  # tiny model: 2 layers x K,V x 4 tokens x 2 kv heads x 16 x float16; a rank holds half


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tp") / "tiny.gguf"), max_position_embeddings=512)


async def _tp1_tokens(model: str, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    config = EngineConfig(model=model, kv_cache_bytes=BLOCKS * TP1_BLOCK_BYTES, block_size=4, max_model_len=256,
                          max_num_seqs=8, enable_prefix_caching=False)
    async with AsyncEngine(config) as engine:
        greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        streams = {rid: engine.generate(ids, greedy, request_id=rid) for rid, ids in prompts.items()}
        results = await asyncio.gather(*(collect(s) for s in streams.values()))
        lone, _, _ = await collect(engine.generate(FORK_PROMPT, SamplingParams(max_tokens=8, temperature=0.0,
                                                                               ignore_eos=True)))
        assert_clean(engine)
        assert engine.stats().kv_blocks_total == BLOCKS
        return {rid: ids for rid, (ids, _, _) in zip(streams, results)}, lone


async def test_greedy_generation_with_two_ranks_equals_one_rank(tiny):
    tp2 = await asyncio.to_thread(run_driver, "engine", tiny, str(BLOCKS * TP1_BLOCK_BYTES // 2))
    assert tp2["kv_blocks"] == BLOCKS  # each rank's pools: half the heads, the same blocks
    assert tp2["preemptions"] >= 1 and tp2["victim_finish"] == "abort" and tp2["health"] == "serving"
    tp1, tp1_lone = await _tp1_tokens(tiny, tp2["prompts"])
    assert tp2["tokens"] == tp1
    assert tp2["lone"] == tp1_lone and tp2["forked"] == [tp1_lone] * 3  # n=3: the forked partial block on both ranks


@pytest.mark.parametrize("how", ["KILL", "STOP"])
def test_a_rank_that_dies_or_hangs_fails_every_open_request(tiny, how):
    result = run_driver("rank_dies", tiny, how, env={"METRALE_TP_STEP_TIMEOUT_S": "3"})
    reason = "was killed by signal 9" if how == "KILL" else "a rank stopped responding"
    assert [o["error"] is not None and reason in o["error"] for o in result["outcomes"]] == [True] * 3, result
    assert all(o["tokens"] >= 1 for o in result["outcomes"])
    assert result["health"] == "unhealthy" and reason in result["refused"]
    # the reason says which detector ended them (the death of the pipe, or the 3 s step timeout): not timed,
    # the driver's 60 s wait is the hang guard
    assert result["follower_status"] == -9


def test_a_size_that_does_not_divide_the_heads_fails_start_and_stops_the_ranks(tiny):
    result = run_driver("refused", tiny, "3")  # 4 heads, 2 kv heads, 96 MLP features
    assert result["error"].startswith("tensor parallel size 3 does not divide this model's 4 attention heads and "
                                      "2 key/value heads"), result
    assert result["health"] == "stopped"


@pytest.mark.real_model
def test_the_default_model_at_three_ranks_equals_one_rank():
    """SmolLM2-135M (Q4_1 on the CPU kernels): 9 heads / 3 kv heads split over 3 ranks."""
    tp3 = run_driver("greedy", "default", "3", timeout_s=300)
    assert tp3["tokens"] == run_driver("greedy", "default", "1", timeout_s=300)["tokens"]
