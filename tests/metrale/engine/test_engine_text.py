"""Text and sampling through the real engine: seeds in a batch, stop strings, penalties, logprobs."""

from __future__ import annotations

import asyncio
import math

import pytest
import pytest_asyncio

from metrale import AsyncEngine, EngineConfig, SamplingParams
from tests.metrale.engine_helpers import assert_clean

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="module")]

PROMPT = "Write a short story about a robot who learns to paint."


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    async with AsyncEngine(EngineConfig(kv_cache_bytes=256 << 20)) as eng:
        yield eng


async def deltas(stream) -> list:
    return [out async for out in stream]


async def test_seed_reproduces_alone_and_inside_a_batch(engine):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = (await engine.complete(PROMPT, seeded)).token_ids
    others = [engine.complete(f"Tell me about topic number {i}.",
                              SamplingParams(max_tokens=16 + i % 5, temperature=0.8 if i % 2 else 0.0,
                                             top_p=0.9, top_k=40 if i % 3 else 0, ignore_eos=True))
              for i in range(16)]
    together = await asyncio.gather(engine.complete(PROMPT, seeded), *others)
    assert together[0].token_ids == alone
    other_seed = await engine.complete(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))
    assert other_seed.token_ids != alone
    assert_clean(engine)


async def test_greedy_equals_top_k_one(engine):
    greedy = await engine.complete(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    top1 = await engine.complete(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=7, ignore_eos=True))
    assert greedy.token_ids == top1.token_ids


@pytest.mark.parametrize("where", ["start", "middle", "end"])
async def test_stop_string_spanning_tokens_never_leaks(engine, where):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = await engine.complete(PROMPT, params)
    tokenizer = engine.tokenizer
    pieces = [tokenizer.decode(full.token_ids[: i + 1], skip_special_tokens=True) for i in range(len(full.token_ids))]
    # a stop string covering the end of one token and the start of the next two
    index = {"start": 1, "middle": len(pieces) // 2, "end": len(pieces) - 3}[where]
    before, after = pieces[index - 1], pieces[index + 2]
    stop = after[max(0, len(before) - 2):]
    assert len(stop) >= 3 and (not before or len(stop) > len(after) - len(before))  # starts inside a token
    expected = full.text[: full.text.index(stop)]
    outs = await deltas(engine.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                               stop=[stop])))
    text = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "stop"
    assert text == expected
    seen = ""
    for out in outs:  # no delta ever holds a piece of the stop string that then matched
        seen += out.text
        assert stop not in seen
    assert_clean(engine)


async def test_include_stop_str_and_overlapping_stops(engine):
    full = await engine.complete(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    word = full.text.split()[3]
    result = await engine.complete(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                          stop=[word, word[:-1] + "@@@"],
                                                          include_stop_str_in_output=True))
    assert result.finish_reason == "stop"
    assert result.text.endswith(word) and result.text == full.text[: full.text.index(word) + len(word)]


async def test_penalties_change_the_output(engine):
    plain = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, repetition_penalty=1.5,
                               frequency_penalty=1.0)
    a = await engine.complete("Repeat after me: la la la la la", plain)
    b = await engine.complete("Repeat after me: la la la la la", penalized)
    assert a.token_ids != b.token_ids
    assert len(set(b.token_ids)) > len(set(a.token_ids))


async def test_logprobs_of_greedy_tokens(engine):
    result = await engine.complete(PROMPT, SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True))
    assert result.logprobs is not None and len(result.logprobs) == 6
    for token_id, lp in zip(result.token_ids, result.logprobs):
        assert lp.token_id == token_id and lp.logprob <= 0 and math.isfinite(lp.logprob)
        assert len(lp.top) == 3 and lp.top[0][0] == token_id  # greedy: the sampled token is the top one
    assert_clean(engine)


async def test_min_tokens_holds_back_eos(engine):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    short = [o async for o in engine.chat(messages, SamplingParams(max_tokens=40, temperature=0))]
    n_short = short[-1].num_output_tokens
    assert short[-1].finish_reason == "stop" and n_short < 20
    held = [o async for o in engine.chat(messages, SamplingParams(max_tokens=40, temperature=0, min_tokens=n_short + 5))]
    assert held[-1].num_output_tokens >= n_short + 5
    assert_clean(engine)
