"""Speculative decoding through the batched engine on tiny random models: the token stream equals
non-speculative greedy exactly, with an oracle proposer (all accepted), an always-wrong one (none
accepted), the real n-gram and draft-model proposers, inside batches mixing speculative, plain and
seeded-sampled requests, with aborts and preemption in the middle; the KV accounting holds after."""

from __future__ import annotations

import asyncio

import pytest

from metrale import AsyncEngine, EngineConfig, SamplingParams
from tests.metrale.engine_helpers import assert_clean, collect, wait_idle
from tests.metrale.model_helpers import write_tiny_model

pytestmark = [pytest.mark.timeout(120)]

PROMPTS = [[5 + i, 30, 7 + i, 60, 11, 40 + i, 9, 50, 13 + i, 70, 21, 8, 33 + i] for i in range(6)]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, seed=7, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64, "adaptive": False}
ADAPTIVE = {**SPEC, "adaptive": True}  # the default policy: each request's draft count follows its acceptance


def config(model: str, speculative=None, **kw) -> EngineConfig:
    base = dict(model=model, kv_cache_bytes=2 << 20, block_size=4, max_num_seqs=16, max_num_batched_tokens=256)
    return EngineConfig(**{**base, **kw}, speculative_config=speculative)


def accepted(engine: AsyncEngine) -> tuple[float, float]:
    labels = {"model_name": engine.metrics.model_name}
    get = engine.registry.get_sample_value
    return (get("metrale_spec_decode_num_draft_tokens_total", labels) or 0,
            get("metrale_spec_decode_num_accepted_tokens_total", labels) or 0)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Non-speculative outputs: greedy per prompt, and one seeded sampled output per prompt."""
    async def run():
        async with AsyncEngine(config(tiny_model)) as engine:
            greedy = await asyncio.gather(*(collect(engine.generate(p, GREEDY)) for p in PROMPTS))
            seeded = await asyncio.gather(*(collect(engine.generate(p, SEEDED)) for p in PROMPTS))
            return greedy, seeded
    return asyncio.run(run())


class OracleProposer:
    """Proposes the known greedy continuation (shifted by `offset`: 1 makes every draft wrong)."""

    def __init__(self, reference, offset: int = 0, vocab: int = 101) -> None:
        self.continuations = {tuple(p): ids for p, (ids, _, _) in zip(PROMPTS, reference)}
        self.offset, self.vocab = offset, vocab

    def propose(self, request_id, token_ids, k):
        for prompt, ids in self.continuations.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                return [(t + self.offset) % self.vocab for t in ids[done:done + k]]
        return []

    def forget(self, request_id):
        pass


@pytest.mark.parametrize("spec", [SPEC, ADAPTIVE], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("offset, all_accepted", [(0, True), (1, False)])
async def test_oracle_and_always_wrong_proposers_give_plain_greedy(tiny_model, reference, offset, all_accepted, spec):
    greedy, _ = reference
    async with AsyncEngine(config(tiny_model, spec), proposer=OracleProposer(greedy, offset)) as engine:
        results = await asyncio.gather(*(collect(engine.generate(p, GREEDY)) for p in PROMPTS))
        assert results == greedy
        drafts, accepted_tokens = accepted(engine)
        assert drafts > 0 and (accepted_tokens == drafts if all_accepted else accepted_tokens == 0)
        if all_accepted:  # all drafts right: far fewer steps than tokens
            assert engine.stats().num_steps < len(PROMPTS) * GREEDY.max_tokens / 2
        await wait_idle(engine)
        assert_clean(engine)


@pytest.mark.parametrize("spec", [SPEC, ADAPTIVE], ids=["fixed", "adaptive"])
async def test_ngram_proposer_gives_plain_greedy_in_a_mixed_batch(tiny_model, reference, spec):
    greedy, seeded = reference
    async with AsyncEngine(config(tiny_model, spec)) as engine:
        streams = [engine.generate(p, GREEDY) for p in PROMPTS] + [engine.generate(p, SEEDED) for p in PROMPTS]
        results = await asyncio.gather(*(collect(s) for s in streams))
        assert results[:len(PROMPTS)] == greedy  # speculated
        assert results[len(PROMPTS):] == seeded  # sampled: never speculated, seeds unchanged
        drafts, _ = accepted(engine)
        assert drafts > 0
        await wait_idle(engine)
        assert_clean(engine)


@pytest.mark.parametrize("same_model", [True, False])
async def test_draft_model_proposer_gives_plain_greedy(tiny_model, reference, tmp_path, same_model):
    greedy, _ = reference
    draft = tiny_model if same_model else write_tiny_model(str(tmp_path / "draft.gguf"), seed=3,
                                                           max_position_embeddings=512, num_hidden_layers=1)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": 64,
            "adaptive": False}
    async with AsyncEngine(config(tiny_model, spec)) as engine:
        results = await asyncio.gather(*(collect(engine.generate(p, GREEDY)) for p in PROMPTS))
        assert results == greedy
        drafts, accepted_tokens = accepted(engine)
        assert drafts > 0
        if same_model:
            assert accepted_tokens == drafts  # the target drafting for itself is always right
        await wait_idle(engine)
        assert_clean(engine)


async def test_stops_inside_accepted_runs_match_plain_decoding(tiny_model, reference):
    greedy, _ = reference
    params = [SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[ids[5]]) for ids, _, _ in greedy]
    async with AsyncEngine(config(tiny_model)) as plain:
        expected = await asyncio.gather(*(collect(plain.generate(p, q)) for p, q in zip(PROMPTS, params)))
    async with AsyncEngine(config(tiny_model, SPEC), proposer=OracleProposer(greedy)) as engine:
        results = await asyncio.gather(*(collect(engine.generate(p, q)) for p, q in zip(PROMPTS, params)))
        assert results == expected and all(finish == "stop" for _, _, finish in results)
        assert_clean(engine)


async def test_aborts_and_preemption_in_the_middle_of_speculative_steps(tiny_model, reference):
    greedy, _ = reference
    # a pool of 20 blocks of 4 tokens: six requests of 13 + 24 tokens cannot all hold their KV
    async with AsyncEngine(config(tiny_model, SPEC, kv_cache_bytes=20 * 1024),
                           proposer=OracleProposer(greedy)) as engine:
        # 1 KiB a block: 2 layers x K,V x 4 tokens x 2 KV heads x 16 x 2 bytes (the CPU's float16 cache)
        assert engine.stats().kv_blocks_total == 20
        streams = [engine.generate(p, GREEDY) for p in PROMPTS]

        async def abort_later(stream, after):
            ids = []
            async for out in stream:
                ids.extend(out.token_ids)
                if len(ids) >= after:
                    await stream.aclose()
                    break
            return ids

        results = await asyncio.gather(*(collect(s) for s in streams[:4]),
                                       *(abort_later(s, 6) for s in streams[4:]))
        assert results[:4] == greedy[:4]
        for partial, (full, _, _) in zip(results[4:], greedy[4:]):
            assert partial == full[:len(partial)]
        assert engine.stats().num_preemptions > 0
        await wait_idle(engine)
        assert_clean(engine)


@pytest.mark.real_model
async def test_ngram_speculation_on_the_real_model_equals_plain_greedy():
    passage = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
               "polished the great lens, and wrote the weather in a small leather book.")
    chats = [[{"role": "user", "content": f"{task}\n\n{passage}"}]
             for task in ("Repeat the following passage word for word:", "Copy the text below exactly:")]
    params = SamplingParams(max_tokens=40, temperature=0)
    outputs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}):
        async with AsyncEngine(EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=4, speculative_config=spec)) as engine:
            outputs.append(await asyncio.gather(*(collect(engine.chat(m, params)) for m in chats)))
            if spec is not None:
                drafts, accepted_tokens = accepted(engine)
                assert accepted_tokens > 0.5 * drafts > 0  # the copy task is what prompt lookup is for
            assert_clean(engine)
    assert outputs[0] == outputs[1]


async def collect_with_usage(stream) -> tuple[list[int], str, str | None, int]:
    """(token ids, text, finish_reason, output tokens counted) of a whole stream."""
    ids, text, finish, counted = [], [], None, 0
    async for out in stream:
        ids.extend(out.token_ids)
        text.append(out.text)
        finish, counted = out.finish_reason, out.num_output_tokens
    return ids, "".join(text), finish, counted


def stop_string_at(engine: AsyncEngine, ids: list[int], position: int) -> str:
    """A stop string that first completes at output token `position` (the text up to it, from its end)."""
    decode = engine.tokenizer.decode
    before, upto = decode(ids[:position], skip_special_tokens=True), decode(ids[:position + 1], skip_special_tokens=True)
    for length in range(1, len(upto) + 1):
        if upto[-length:] not in before and upto[-length:].strip():
            return upto[-length:]
    raise AssertionError(f"no stop string completes at {position}")


async def test_stop_strings_inside_accepted_runs_match_plain_decoding(tiny_model, reference):
    # every draft accepted: the stop string completes inside a run of up to 5 tokens, never at its end alone
    greedy, _ = reference
    async with AsyncEngine(config(tiny_model)) as plain:
        params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                 stop=[stop_string_at(plain, ids, position)], include_stop_str_in_output=include)
                  for (ids, _, _), position, include in zip(greedy, (2, 5, 8, 9, 3, 7), (False, True) * 3)]
        expected = await asyncio.gather(*(collect_with_usage(plain.generate(p, q)) for p, q in zip(PROMPTS, params)))
    assert all(finish == "stop" and len(ids) < 24 for ids, _, finish, _ in expected)
    async with AsyncEngine(config(tiny_model, SPEC), proposer=OracleProposer(greedy)) as engine:
        results = await asyncio.gather(*(collect_with_usage(engine.generate(p, q)) for p, q in zip(PROMPTS, params)))
        assert results == expected
        assert all(counted == len(ids) for ids, _, _, counted in results)
        drafts, accepted_tokens = accepted(engine)
        assert accepted_tokens == drafts > 0
        await wait_idle(engine)
        assert_clean(engine)


@pytest.mark.real_model
async def test_ngram_speculation_stops_exactly_where_plain_decoding_does():
    # the repro: stop ["."] gave 5 token ids plain, 6 speculative (the accepted run kept past the stop)
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat"
    outputs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}):
        async with AsyncEngine(EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=4, speculative_config=spec)) as engine:
            period, = engine.tokenizer.encode(".", add_special_tokens=False)
            kinds = [SamplingParams(max_tokens=32, temperature=0, stop=["."]),
                     SamplingParams(max_tokens=32, temperature=0, stop=["."], include_stop_str_in_output=True),
                     SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[period]),
                     SamplingParams(max_tokens=7, temperature=0),
                     SamplingParams(max_tokens=64, temperature=0)]  # eos, or the length
            outputs.append([await collect_with_usage(engine.generate(prompt, params)) for params in kinds])
            if spec is not None:
                assert accepted(engine)[1] > 0
            assert_clean(engine)
            eos = set(engine.tokenizer.eos_token_ids)
    # the first sentence comes out the same: every stop lands where plain decoding's does
    assert outputs[0][:3] == outputs[1][:3]
    assert [finish for _, _, finish, _ in outputs[0][:3]] == ["stop"] * 3
    sentence = len(outputs[0][2][0])  # its token ids, the period included (stop_token_ids keeps it)
    # Past it the model's next token is a near-tie (" the" or a newline after "mat."), and a verification
    # chunk's rows are not bit-identical to one-row decode steps (the prefill and decode attention kernels
    # sum in different orders; int12 activations turn ~3e-5 into logit differences of ~0.03), so a longer
    # greedy run may take the other branch (it did on an AVX-512 Zen 4, at the second "mat."). What must hold
    # either way: it starts with that sentence, ends at its length or at eos, never past max_tokens, and
    # counts what it returned.
    for kind, max_tokens in ((3, 7), (4, 64)):
        for ids, _, finish, counted in (outputs[0][kind], outputs[1][kind]):
            assert ids[:sentence] == outputs[0][2][0]
            assert counted == len(ids) <= max_tokens
            assert (finish == "length" and len(ids) == max_tokens
                    or finish == "stop" and len(ids) < max_tokens and not eos & set(ids[:-1]))
