"""Token masks and structured outputs through AsyncEngine on the real default model: logit_bias,
allowed_token_ids and bad_words change the output as specified; constrained requests stay valid across
preemption (recompute) and end with "length" when max_tokens cuts an object; a grammar that does not
compile fails only its own request; the runner forgets every finished request's matcher."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import pytest_asyncio

from metrale import AsyncEngine, EngineConfig, RequestFailedError, SamplingParams
from metrale.errors import InvalidStructuredOutputError, InvalidTokenIdError
from tests.metrale.engine_helpers import Runners, assert_clean, collect, wait_idle

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

PROMPT = "The capital of France is"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "maxLength": 16}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give a JSON object describing a person named Anna, 31, from Oslo."}]


@pytest.fixture(scope="module")
def runners() -> Runners:
    return Runners()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(runners):
    # 8 MiB of float32 KV = 11 blocks of 16 tokens: four ~100-token requests must preempt each other
    config = EngineConfig(kv_cache_bytes=8 << 20, max_model_len=256, max_num_seqs=8, kv_cache_dtype="float32")
    async with AsyncEngine(config, runner_factory=runners) as eng:
        yield eng


async def test_logit_bias_plus_100_forces_its_token_under_greedy(engine):
    target = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    ids, _, _ = await collect(engine.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                                     logit_bias={target: 100})))
    assert ids == [target] * 4
    with pytest.raises(InvalidTokenIdError, match=r"logit_bias token ids must be in \[0, 49152\)"):
        engine.generate(PROMPT, SamplingParams(logit_bias={10**6: 1}))


async def test_allowed_token_ids_restrict_every_token(engine):
    allowed = engine.tokenizer.encode(" one two three four five six", add_special_tokens=False)
    ids, text, _ = await collect(engine.generate(PROMPT, SamplingParams(max_tokens=24, temperature=1.0, seed=3,
                                                                        ignore_eos=True, allowed_token_ids=allowed)))
    assert len(ids) == 24 and set(ids) <= set(allowed), text


async def test_bad_words_never_appear(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = await engine.complete(PROMPT, greedy)
    assert "Paris" in plain.text
    banned = await engine.complete(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                          bad_words=["Paris", "France"]))
    for word in (" Paris", "Paris", " France", "France"):
        seq = engine.tokenizer.encode(word, add_special_tokens=False)
        assert all(banned.token_ids[i:i + len(seq)] != seq for i in range(len(banned.token_ids))), (word, banned.text)
    assert banned.text != plain.text


async def test_structured_outputs_survive_preemption(engine, caplog, runners):
    params = SamplingParams(max_tokens=90, temperature=0.7, seed=5, structured_outputs={"json": PERSON})
    await engine.prepare(params)
    before = engine.stats().num_preemptions
    with caplog.at_level(logging.WARNING, logger="metrale"):
        results = await asyncio.gather(*(collect(engine.chat(ASK, SamplingParams(
            max_tokens=90, temperature=0.7, seed=i, structured_outputs={"json": PERSON}))) for i in range(4)),
            collect(engine.chat(ASK, SamplingParams(max_tokens=60, temperature=0))))
    assert engine.stats().num_preemptions > before, "the KV pool was meant to force preemption"
    for ids, text, finish in results[:4]:
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), PERSON)
    assert not [r for r in caplog.records if "resync" in r.getMessage()]
    await wait_idle(engine)
    await collect(engine.generate(PROMPT, SamplingParams(max_tokens=1)))  # a step that carries the finished ids
    assert runners.runner.constraints.num_tracked == 0
    assert_clean(engine)


async def test_max_tokens_mid_object_ends_with_length(engine):
    ids, text, finish = await collect(engine.chat(ASK, SamplingParams(max_tokens=5, temperature=0,
                                                                      structured_outputs={"json": PERSON})))
    assert finish == "length" and len(ids) == 5 and text.lstrip().startswith("{")
    assert_clean(engine)


async def test_an_unprepared_bad_grammar_fails_only_its_request(engine):
    bad = SamplingParams(max_tokens=8, structured_outputs={"json": {"type": "nonsense"}})
    with pytest.raises(InvalidStructuredOutputError, match="nonsense"):
        await engine.prepare(bad)
    failing = engine.chat(ASK, bad)
    fine = engine.chat(ASK, SamplingParams(max_tokens=8, temperature=0))
    with pytest.raises(RequestFailedError, match="Invalid type: nonsense"):
        await collect(failing)
    assert (await collect(fine))[2] == "length"
    await wait_idle(engine)
    assert_clean(engine)
