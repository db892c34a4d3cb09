"""The OpenAI surface on a tiny real engine, in process: n choices (shared prompt blocks, streamed with
their index, usage counting the prompt once), echo and logprobs, vLLM's prompt_logprobs and
usage.prompt_tokens_details.cached_tokens. Every scenario ends with the KV integrity check."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.tiny_engine import app, clean, engine  # noqa: F401 (fixtures)
from tests.server.fakes import call

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio(loop_scope="module")]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "hello world, this is a prompt"
MESSAGES = [{"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}


async def test_n_choices_are_indexed_and_usage_counts_the_prompt_once(app, engine):
    one = (await call(app, "POST", COMPLETIONS, {"prompt": PROMPT, **GREEDY})).json()
    r = await call(app, "POST", COMPLETIONS, {"prompt": PROMPT, "n": 3, **GREEDY})
    assert r.status == 200, r.body
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert {c["text"] for c in body["choices"]} == {one["choices"][0]["text"]}  # greedy: the same text each
    prompt_tokens = one["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 15 and body["usage"]["total_tokens"] == prompt_tokens + 15
    await clean(engine)


async def test_n_chat_stream_sends_every_choice_with_its_index(app, engine):
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "n": 2, "stream": True,
                                       "stream_options": {"include_usage": True}, **GREEDY})
    assert r.status == 200, r.body
    *chunks, usage, done = r.events()
    assert done == "[DONE]"
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"][0]["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}
    texts = ["".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == i)
             for i in (0, 1)]
    assert texts[0] == texts[1] and texts[0]
    assert usage["usage"]["completion_tokens"] == 10
    await clean(engine)


async def test_seeded_n_is_reproducible(app, engine):
    body = {"prompt": PROMPT, "n": 2, "seed": 11, "temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
    first = (await call(app, "POST", COMPLETIONS, body)).json()["choices"]
    second = (await call(app, "POST", COMPLETIONS, body)).json()["choices"]
    assert first == second and first[0]["text"] != first[1]["text"]
    await clean(engine)


async def test_a_client_leaving_mid_stream_aborts_every_choice(app, engine):
    before = engine.stats().requests_finished
    r = await call(app, "POST", COMPLETIONS, {"prompt": PROMPT, "n": 4, "stream": True, "temperature": 0,
                                              "max_tokens": 400, "ignore_eos": True}, disconnect_after_chunks=3)
    assert r.status == 200
    await clean(engine)
    assert engine.stats().requests_finished == before + 4


async def test_echo_returns_the_prompt_first(app, engine):
    plain = (await call(app, "POST", COMPLETIONS, {"prompt": PROMPT, **GREEDY})).json()["choices"][0]
    echoed = (await call(app, "POST", COMPLETIONS, {"prompt": PROMPT, "echo": True, **GREEDY})).json()["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    events = (await call(app, "POST", COMPLETIONS, {"prompt": PROMPT, "echo": True, "stream": True, **GREEDY})).events()
    assert events[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == echoed["text"]
    await clean(engine)


async def test_echo_with_logprobs_scores_the_prompt_tokens(app, engine):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, **GREEDY}
    full = (await call(app, "POST", COMPLETIONS, body)).json()
    logprobs = full["choices"][0]["logprobs"]
    num_prompt = full["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == num_prompt + 5
    assert "".join(logprobs["tokens"]) == full["choices"][0]["text"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(v <= 0 for v in logprobs["token_logprobs"][1:])
    vllm = (await call(app, "POST", COMPLETIONS, {"prompt": PROMPT, "prompt_logprobs": 2, **GREEDY})).json()
    prompt_lps = vllm["choices"][0]["prompt_logprobs"]
    assert len(prompt_lps) == num_prompt and prompt_lps[0] is None
    scored = [[v for v in entry.values() if v["decoded_token"] == token][0]["logprob"]
              for entry, token in zip(prompt_lps[1:], logprobs["tokens"][1:num_prompt])]
    assert scored == logprobs["token_logprobs"][1:num_prompt]
    streamed = (await call(app, "POST", COMPLETIONS, {**body, "stream": True})).events()
    first = streamed[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][:num_prompt] == logprobs["token_logprobs"][:num_prompt]
    await clean(engine)


async def test_chat_prompt_logprobs_at_the_top_level(app, engine):
    body = (await call(app, "POST", CHAT, {"messages": MESSAGES, "prompt_logprobs": 0, **GREEDY})).json()
    prompt_lps = body["prompt_logprobs"]
    assert len(prompt_lps) == body["usage"]["prompt_tokens"] and prompt_lps[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1 for entry in prompt_lps[1:])
    await clean(engine)


@pytest.mark.parametrize("stream", [False, True])
async def test_cached_tokens_count_the_prefix_cache_hits(app, engine, stream):
    prompt = f"{stream}: a long shared prefix for the cache test " * 3  # distinct from its first token on
    body = {"prompt": prompt, "stream": stream, **GREEDY}
    if stream:
        body["stream_options"] = {"include_usage": True}

    async def usage():
        r = await call(app, "POST", COMPLETIONS, body)
        return r.events()[-2]["usage"] if stream else r.json()["usage"]

    first, second = await usage(), await usage()
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["prompt_tokens"] and cached % 4 == 0  # whole blocks, never the last token
    chat = [(await call(app, "POST", CHAT, {"messages": MESSAGES, **GREEDY})).json()["usage"] for _ in range(2)]
    assert chat[1]["prompt_tokens_details"]["cached_tokens"] > 0
    await clean(engine)
