"""Hypothesis-generated request bodies against the real server: wrong types, missing fields, huge
numbers, invalid UTF-8. None may give a 5xx, and none may leave a KV block allocated."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.serve import SMALL, ServerProcess

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
huge = st.sampled_from([2**63, 2**64, 10**30, -(2**63) - 1, 1e308, -1e308])
text = st.text(max_size=20)
token_ids = st.lists(st.integers(-5, 60_000), max_size=5)
content = st.one_of(text, st.none(), st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url"])}, optional={"text": text}), max_size=2))
roles = st.sampled_from(["user", "system", "assistant", "tool", "robot", ""])
message = st.fixed_dictionaries({"role": roles, "content": content}) | st.fixed_dictionaries(
    {}, optional={"role": roles, "content": content})
# Plausible values: the right types, in or just out of range.
plausible = {
    "max_tokens": st.one_of(st.integers(-3, 0), st.just(600)), "model": st.just("no-such-model"),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-5, 100_000),
    "min_p": st.floats(-1, 2), "seed": st.integers(-(2**70), 2**70), "stop": text | st.lists(text, max_size=3),
    "stop_token_ids": token_ids, "n": st.integers(0, 3), "presence_penalty": st.floats(-5, 5),
    "frequency_penalty": st.floats(-5, 5), "repetition_penalty": st.floats(-1, 3),
    "min_tokens": st.integers(-1, 5), "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(text, st.floats(-100, 100), max_size=2),
    "logprobs": st.integers(-1, 30), "echo": st.booleans(), "top_logprobs": st.integers(-1, 30),
    "max_completion_tokens": st.integers(-3, 0),
    "prompt": st.one_of(text, token_ids, st.lists(text, max_size=2), st.lists(token_ids, max_size=2)),
    "messages": st.lists(message, max_size=3),
}
# Valid values; max_tokens stays tiny so that valid bodies finish in a step or two.
vocab_ids = st.lists(st.integers(0, 49_151), min_size=1, max_size=5)
valid = {
    "max_tokens": st.integers(1, 2), "stream": st.booleans(), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50), "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**32), "stop": st.lists(st.text(min_size=1, max_size=5), max_size=2),
    "stop_token_ids": vocab_ids, "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "min_tokens": st.integers(0, 1), "ignore_eos": st.booleans(),
}
completion_valid = {**valid, "logprobs": st.integers(0, 5), "prompt": st.text(min_size=1, max_size=30) | vocab_ids}
chat_valid = {**valid, "logprobs": st.booleans(), "max_completion_tokens": st.integers(1, 2),
              "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                          "content": text}), min_size=1, max_size=3)}


@st.composite
def body(draw, valid_fields: dict, required: str) -> dict:
    """A body of a few fields, mostly valid, some plausible but wrong; a third get 1-2 junk fields."""
    payload = {"max_tokens": draw(st.one_of(*[valid_fields["max_tokens"]] * 3, plausible["max_tokens"]))}
    if draw(st.integers(0, 9)) < 9:  # 1 in 10 lacks its required field
        payload[required] = draw(valid_fields[required] | plausible[required])
    names = draw(st.lists(st.sampled_from(sorted(set(plausible) - {required, "max_tokens"})), max_size=4,
                          unique=True))
    for name in names:
        choices = [plausible[name]] + [valid_fields[name]] * 2 if name in valid_fields else [plausible[name]]
        payload[name] = draw(st.one_of(*choices))
    if draw(st.integers(0, 2)) == 2:
        for name in draw(st.lists(st.sampled_from(sorted(plausible)), min_size=1, max_size=2)):
            payload[name] = draw(junk | huge)
    return payload


completion = body(completion_valid, "prompt")
chat = body(chat_valid, "messages")


def _invalid_utf8(data: bytes, position: int) -> bytes:
    position %= len(data) + 1
    return data[:position] + b"\xff\xfe\xc3" + data[position:]


json_completion = st.tuples(st.just("/v1/completions"), completion.map(lambda d: json.dumps(d).encode()))
json_chat = st.tuples(st.just("/v1/chat/completions"), chat.map(lambda d: json.dumps(d).encode()))
bodies = st.one_of(
    json_completion, json_completion, json_completion, json_chat, json_chat, json_chat,
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
              st.builds(_invalid_utf8, completion.map(lambda d: json.dumps(d, ensure_ascii=False).encode()),
                        st.integers(0, 200))),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.binary(max_size=64)),
)


@pytest.fixture(scope="module")
def server():
    with ServerProcess(*SMALL, "--max-num-seqs", "4") as server:
        yield server


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=bodies)
def test_bad_bodies_never_5xx_and_never_leak_blocks(server, case):
    path, body = case
    status, response = server.post(path, body, timeout_s=60)
    assert status < 500, (status, body, response)
    if status == 200:
        assert b'data: {"error"' not in response, response  # no failure after the stream started
    else:
        error = json.loads(response)["error"]
        assert set(error) == {"message", "type", "param", "code"}, response
    assert server.idle(), (body, server.gauges())


def test_server_still_serves_after_the_fuzzing(server):
    status, body = server.post_json("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
