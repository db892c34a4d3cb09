"""Parallel sampling (SamplingParams.n > 1) on a tiny real model: the n sequences fork from one
computed prompt (shared full blocks, a copied partial block), sample their own streams (seed + i),
end together on abort or failure, and free every block."""

from __future__ import annotations

import asyncio

import pytest

from metrale import AsyncEngine, EngineConfig, RequestFailedError, SamplingParams
from metrale.errors import InvalidParamsError
from metrale.engine.stream import GroupStream, RequestStream
from tests.metrale.engine_helpers import assert_clean, collect, wait_idle

pytestmark = [pytest.mark.timeout(60)]

PROMPT = [5, 30, 7, 60, 11, 40, 9, 50, 13, 70, 21, 8, 33, 44]  # 14 tokens: 3 full blocks of 4 and a partial one
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def config(model: str, **kw) -> EngineConfig:
    kw = {"kv_cache_bytes": 2 << 20, "block_size": 4, "max_num_seqs": 16, "max_num_batched_tokens": 128, **kw}
    return EngineConfig(model=model, **kw)


async def by_index(stream) -> dict[int, tuple[list[int], str, str]]:
    """Each sequence's (token ids, text, finish_reason), by its index."""
    ids: dict[int, list[int]] = {}
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    async for out in stream:
        ids.setdefault(out.index, []).extend(out.token_ids)
        texts.setdefault(out.index, []).append(out.text)
        if out.finish_reason is not None:
            assert out.index not in finish, "a sequence finished twice"
            finish[out.index] = out.finish_reason
    return {i: (ids[i], "".join(texts[i]), finish[i]) for i in finish}


async def test_forked_sequences_compute_what_a_lone_request_computes(tiny_model):
    async with AsyncEngine(config(tiny_model)) as engine:
        alone = await collect(engine.generate(PROMPT, GREEDY))
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=3))
        assert isinstance(stream, GroupStream)
        results = await by_index(stream)
        assert results == {i: alone for i in range(3)}  # a wrong partial-block copy changes the tokens
        assert_clean(engine)


async def test_n1_is_a_plain_stream(tiny_model):
    async with AsyncEngine(config(tiny_model)) as engine:
        stream = engine.generate(PROMPT, GREEDY)
        assert isinstance(stream, RequestStream)
        outs = [out async for out in stream]
        assert {out.index for out in outs} == {0}
        assert_clean(engine)


async def peak_blocks(model: str, caching: bool, streams) -> int:
    """The most KV blocks in use at once while `streams(engine)` run to their end on a fresh engine."""
    async with AsyncEngine(config(model, enable_prefix_caching=caching)) as engine:
        await asyncio.gather(*(by_index(stream) for stream in streams(engine)))
        await wait_idle(engine)
        assert_clean(engine)
        return round(engine.stats().peak_kv_usage * engine.stats().kv_blocks_total)


@pytest.mark.parametrize("caching", [True, False])
async def test_sequences_share_the_prompt_blocks(tiny_model, caching):
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    group = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, n=4)
    grouped = await peak_blocks(tiny_model, caching, lambda e: [e.generate(PROMPT, group)])
    separate = await peak_blocks(tiny_model, caching, lambda e: [e.generate(PROMPT, params) for _ in range(4)])
    # 15 tokens at most: the group holds 4 blocks + 3 copies of the partial one. 4 separate requests hold 4
    # blocks each, or with prefix caching share the 3 full ones (a later request of the same step hits them)
    assert (grouped, separate) == ((7, 7) if caching else (7, 16))


async def test_seeded_sequences_are_reproducible_and_use_seed_plus_index(tiny_model):
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True, seed=7, n=3)
    async with AsyncEngine(config(tiny_model)) as engine:
        first = await by_index(engine.generate(PROMPT, params))
        second = await by_index(engine.generate(PROMPT, params))
        assert first == second
        assert len({tuple(first[i][0]) for i in range(3)}) == 3  # each its own stream
        for i in range(3):  # sequence i samples as a lone request seeded seed + i
            lone = await collect(engine.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.0,
                                                                         ignore_eos=True, seed=7 + i)))
            assert lone == first[i]
        assert_clean(engine)


async def test_aborting_the_request_mid_stream_ends_every_sequence(tiny_model):
    async with AsyncEngine(config(tiny_model)) as engine:
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, n=3),
                                 request_id="group")
        finished, aborted = {}, False
        async for out in stream:
            if out.num_output_tokens >= 3 and not aborted:
                assert engine.abort("group")  # the request's id: every sequence
                assert not engine.abort("group")  # already aborting
                aborted = True
            if out.finish_reason is not None:
                finished[out.index] = out.finish_reason
        assert finished == {0: "abort", 1: "abort", 2: "abort"}
        await wait_idle(engine)
        assert_clean(engine)


async def test_closing_the_stream_mid_way_frees_everything(tiny_model):
    async with AsyncEngine(config(tiny_model)) as engine:
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, n=4))
        async for out in stream:
            if out.num_output_tokens >= 2:
                break  # leaving the loop aborts every sequence
        await wait_idle(engine)
        assert engine.stats().requests_finished == 4
        assert_clean(engine)


async def test_one_failing_sequence_fails_the_request_cleanly(tiny_model):
    async with AsyncEngine(config(tiny_model, failpoints="sample=@victim#2")) as engine:
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, n=3),
                                 request_id="victim")
        with pytest.raises(RequestFailedError):
            await by_index(stream)
        await wait_idle(engine)
        assert_clean(engine)
        assert await collect(engine.generate(PROMPT, GREEDY))  # still serving


async def test_more_sequences_than_seats_is_refused_before_any_is_built(tiny_model, monkeypatch):
    async with AsyncEngine(config(tiny_model, max_num_seqs=4)) as engine:
        built = []
        monkeypatch.setattr(engine._submission._outputs, "new_request", lambda *args, **kwargs: built.append(args))
        for n in (5, 10**6):  # 10**5 once took 440 s to refuse, building every sequence first
            with pytest.raises(InvalidParamsError, match=rf"n must be at most max_num_seqs \(4\), got {n}$"):
                engine.generate(PROMPT, SamplingParams(max_tokens=2, n=n))
        assert built == []
        assert_clean(engine)
