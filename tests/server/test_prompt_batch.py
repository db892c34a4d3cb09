"""A list of prompts on /v1/completions (OpenAI's batch form; LangChain's `OpenAI().batch()` sends it): on a tiny
real engine, choice i * n + j is prompt i's sequence j, streamed and not, with the usage summed over the prompts;
the number of prompts is bounded before any work; echo and prompt_logprobs are refused by name. Every scenario ends
with the KV integrity check."""

from __future__ import annotations

import pytest

from metrale.errors import QueueFullError
from metrale.server.app import ServerApp
from metrale.server.protocol import MAX_PROMPTS
from tests.server.tiny_engine import app, clean, engine  # noqa: F401 (fixtures)
from tests.server.fakes import FakeEngine, call

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio(loop_scope="module")]
COMPLETIONS = "/v1/completions"
PROMPTS = ["hello world, this is a prompt", "a different and longer prompt than the first one"]
GREEDY = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}


async def one_by_one(app, prompts) -> list[dict]:
    return [(await call(app, "POST", COMPLETIONS, {"prompt": p, **GREEDY})).json() for p in prompts]


async def test_choices_are_indexed_prompt_times_n_plus_j_and_usage_sums_the_prompts(app, engine):
    singles = await one_by_one(app, PROMPTS)
    r = await call(app, "POST", COMPLETIONS, {"prompt": PROMPTS, "n": 2, **GREEDY})
    assert r.status == 200, r.body
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body["choices"]]
    assert texts == [singles[0]["choices"][0]["text"]] * 2 + [singles[1]["choices"][0]["text"]] * 2
    assert texts[0] != texts[2]
    prompt_tokens = sum(s["usage"]["prompt_tokens"] for s in singles)
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 16
    assert body["usage"]["total_tokens"] == prompt_tokens + 16
    await clean(engine)


async def test_token_id_prompts_and_a_stream_with_usage(app, engine):
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    singles = [(await call(app, "POST", COMPLETIONS, {"prompt": p, **GREEDY})).json() for p in ids]
    r = await call(app, "POST", COMPLETIONS, {"prompt": ids, "stream": True,
                                              "stream_options": {"include_usage": True}, **GREEDY})
    assert r.status == 200, r.body
    *chunks, usage, done = r.events()
    assert done == "[DONE]"
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)}
    assert texts == {i: singles[i]["choices"][0]["text"] for i in (0, 1)}
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"] == "length"]
    assert sorted(finishes) == [0, 1]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 7
    assert usage["usage"]["completion_tokens"] == 8
    await clean(engine)


async def test_continuous_usage_counts_every_prompt_seen_so_far(app, engine):
    r = await call(app, "POST", COMPLETIONS, {"prompt": [[5, 6, 7], [8, 9]], "stream": True, **GREEDY,
                                              "stream_options": {"continuous_usage_stats": True}})
    *chunks, last, done = r.events()
    assert last["usage"]["prompt_tokens"] == 5 and last["usage"]["completion_tokens"] == 8
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 8
    await clean(engine)


async def test_a_batch_of_one_is_a_single_prompt(app, engine):
    single = (await one_by_one(app, PROMPTS[:1]))[0]
    body = (await call(app, "POST", COMPLETIONS, {"prompt": PROMPTS[:1], **GREEDY})).json()
    assert body["choices"][0]["text"] == single["choices"][0]["text"] and body["usage"] == single["usage"]
    await clean(engine)


async def test_a_client_leaving_mid_stream_aborts_every_prompt(app, engine):
    body = {"prompt": PROMPTS, "n": 2, "stream": True, "temperature": 0, "max_tokens": 200, "ignore_eos": True}
    r = await call(app, "POST", COMPLETIONS, body, disconnect_after_chunks=3)
    assert r.status == 200
    await clean(engine)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": ["a", [1, "b"]]}, "prompt"),
    ({"prompt": ["a", 3]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"], "echo": True}, "echo"),
    ({"prompt": ["a", "b"], "prompt_logprobs": 0}, "prompt_logprobs"),
])
async def test_bad_prompt_lists_are_400s_that_queue_nothing(body, param):
    engine = FakeEngine()
    r = await call(ServerApp(engine, manage_engine=False), "POST", COMPLETIONS, {**body, "max_tokens": 2})
    assert r.status == 400, r.body
    assert r.json()["error"]["param"] == param
    assert engine.submitted == []


async def test_a_refused_second_prompt_aborts_the_first():
    engine = FakeEngine(step_s=0.05)
    app = ServerApp(engine, manage_engine=False)
    original = engine.generate

    def generate_once(*args, **kwargs):
        if engine.submitted:
            raise QueueFullError("queue is full")
        return original(*args, **kwargs)

    engine.generate = generate_once
    r = await call(app, "POST", COMPLETIONS, {"prompt": ["a b", "c d"], "max_tokens": 5})
    assert r.status == 429, r.body
    assert len(engine.submitted) == 1 and engine.aborted == [engine.generated_ids[0]]
