"""ServerApp response shapes and error mapping, in-process over ASGI with a scripted engine.

Behaviour against the real engine is in test_openai_client.py and the other real-server tests.
"""

from __future__ import annotations

import asyncio

import pytest

from metrale.errors import QueueFullError
from metrale.server.app import ServerApp
from tests.server.fakes import FakeEngine, call

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def app(engine: FakeEngine) -> ServerApp:
    return ServerApp(engine, manage_engine=False)


async def test_completion_shape(app):
    r = await call(app, "POST", COMPLETIONS, {"model": "fake-model", "prompt": "a b c", "max_tokens": 3})
    assert r.status == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "Hello world!", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_completion_stream_shape(app):
    r = await call(app, "POST", COMPLETIONS, {"prompt": "a b", "max_tokens": 3, "stream": True,
                                               "stream_options": {"include_usage": True}})
    assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
    *chunks, usage, done = r.events()
    assert done == "[DONE]"
    assert {(c["id"], c["created"], c["object"]) for c in chunks + [usage]} == \
        {(chunks[0]["id"], chunks[0]["created"], "text_completion")}
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world!"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["usage"] is None for c in chunks)
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 3,
                                                         "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}


async def test_chat_shapes(app):
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "max_tokens": 2})
    body = r.json()
    assert r.status == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert body["choices"][0]["finish_reason"] == "length"
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "max_tokens": 2, "stream": True})
    *chunks, done = r.events()
    assert done == "[DONE]" and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello world"
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert "usage" not in chunks[0]  # only with include_usage


async def test_chat_default_max_tokens_and_content_parts(engine):
    app = ServerApp(engine, manage_engine=False, default_max_tokens=4)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}]
    r = await call(app, "POST", CHAT, {"messages": parts})
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert engine.submitted[-1][1].max_tokens == 4
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "max_completion_tokens": 1, "max_tokens": 3})
    assert r.json()["usage"]["completion_tokens"] == 1


async def test_extra_sampling_fields_reach_sampling_params(app, engine):
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "top_k": 5, "min_p": 0.1, "seed": 7,
            "stop": "x", "repetition_penalty": 1.1, "ignore_eos": True, "user": "ignored", "unknown": 1,
            "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_tokens": 1,
            "stop_token_ids": [4], "include_stop_str_in_output": True, "skip_special_tokens": False}
    assert (await call(app, "POST", COMPLETIONS, body)).status == 200
    prompt, params = engine.submitted[-1]
    assert prompt == [1, 2, 3]
    assert (params.temperature, params.top_k, params.min_p, params.seed, params.stop, params.ignore_eos) == \
        (0.0, 5, 0.1, 7, ("x",), True)
    assert (params.top_p, params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == \
        (0.9, 0.5, -0.5, 1.1)
    assert (params.min_tokens, params.stop_token_ids, params.include_stop_str_in_output,
            params.skip_special_tokens) == (1, (4,), True, False)


async def test_request_id_names_the_request_and_the_response(app, engine):
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "max_tokens": 1, "request_id": "abc"})
    assert r.status == 200 and r.json()["id"] == "chatcmpl-abc"
    r = await call(app, "POST", COMPLETIONS, {"prompt": "a", "max_tokens": 1, "request_id": "abc", "stream": True})
    assert r.events()[0]["id"] == "cmpl-abc"
    assert engine.generated_ids[-2:] == ["abc", "abc"]


@pytest.mark.parametrize("path, body, status, param", [
    (COMPLETIONS, b"{not json", 400, None),
    (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None),
    (COMPLETIONS, b"[1, 2]", 400, None),
    (COMPLETIONS, {"max_tokens": 3}, 400, None),  # prompt missing
    (COMPLETIONS, {"prompt": "a", "max_tokens": "3"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "a", "temperature": 3.5}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "a", "seed": 2**70}, 400, "seed"),
    (COMPLETIONS, {"prompt": "a", "n": 0}, 400, "n"),
    (COMPLETIONS, {"prompt": "a", "n": 2**63 - 2}, 400, "n"),  # built n sequences' state first: ran out of memory
    (CHAT, {"messages": MESSAGES, "n": 129}, 400, "n"),
    (COMPLETIONS, {"prompt": "a", "n": 2, "best_of": 3}, 400, "best_of"),
    (COMPLETIONS, {"prompt": "a", "best_of": 2}, 400, "best_of"),
    (COMPLETIONS, {"prompt": "a", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "a", "request_id": "ok\nINFO forged log line"}, 400, "request_id"),
    (COMPLETIONS, {"prompt": "a", "request_id": "abc\n"}, 400, "request_id"),
    (CHAT, {"messages": MESSAGES, "request_id": "x" * 100_000}, 400, "request_id"),
    (CHAT, {"messages": MESSAGES, "request_id": "with space"}, 400, "request_id"),
    (CHAT, {"messages": MESSAGES, "request_id": ""}, 400, "request_id"),
    *((CHAT, {"messages": MESSAGES, "logit_bias": {key: 1}}, 400, "logit_bias")
      for key in ("+5", " 5", "5 ", "1_0", "\u0665", "-1", "0x5", "5\n", "1" * 11)),
    (CHAT, {"messages": MESSAGES, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (CHAT, {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    (COMPLETIONS, {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["a", {"b": 1}]}, 400, "prompt"),  # a list of prompts is fine, not of objects
    (COMPLETIONS, {"prompt": "a", "model": "other"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [123]}, 400, "messages[0]"),
    (CHAT, {"messages": [{}]}, 400, "messages[0]"),
    (CHAT, {"messages": [{"role": 123}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools"),
])
async def test_bad_requests_are_openai_errors(app, engine, path, body, status, param):
    r = await call(app, "POST", path, body)
    assert r.status == status, r.body
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert engine.submitted == [] and engine.live == {}


async def test_server_side_rejections_are_counted(app, engine):
    await call(app, "POST", COMPLETIONS, b"{")
    await call(app, "POST", COMPLETIONS, {"prompt": "a", "model": "nope"})
    assert engine.registry.get_sample_value("metrale_requests_rejected_total",
                                            {"model_name": "fake-model", "reason": "invalid_request"}) == 2


async def test_too_long_prompt_names_the_limit(app):
    r = await call(app, "POST", COMPLETIONS, {"prompt": "a " * 70, "max_tokens": 1})
    assert r.status == 400 and "max_model_len (64)" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"


async def test_queue_full_is_429_and_draining_503(app, engine):
    engine.reject = QueueFullError("waiting queue is full (1)")
    r = await call(app, "POST", COMPLETIONS, {"prompt": "a"})
    assert r.status == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    engine.reject = None
    engine.state = "draining"
    r = await call(app, "POST", CHAT, {"messages": MESSAGES})
    assert r.status == 503 and r.json()["error"]["code"] == "draining"
    assert (await call(app, "GET", "/health")).status == 503


async def test_body_limit_is_413(engine):
    app = ServerApp(engine, manage_engine=False, max_body_bytes=100)
    r = await call(app, "POST", COMPLETIONS, {"prompt": "x" * 200})
    assert r.status == 413 and r.json()["error"]["code"] == "request_too_large"


async def test_api_key(engine):
    app = ServerApp(engine, manage_engine=False, api_key="sekret")
    assert (await call(app, "POST", COMPLETIONS, {"prompt": "a"})).status == 401
    r = await call(app, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status == 401 and r.json()["error"]["type"] == "authentication_error"
    assert (await call(app, "GET", "/v1/models", headers={"Authorization": "Bearer sekret"})).status == 200
    assert (await call(app, "GET", "/health")).status == 200
    assert (await call(app, "GET", "/metrics")).status == 200


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("GET", "/v1/models/fake-model"),
                                              ("POST", CHAT), ("POST", "/v1/responses"), ("GET", "/server_info"),
                                              ("GET", "/get_model_info"), ("GET", "/get_load"), ("GET", "/nope"),
                                              ("GET", "/openapi.json"), ("POST", "/v1/messages"),
                                              ("POST", "/tokenize"), ("GET", "/api/tags"), ("GET", "/")])
async def test_every_route_but_health_and_metrics_needs_the_key(engine, method, path):
    app = ServerApp(engine, manage_engine=False, api_key="sekret")
    r = await call(app, method, path, {"messages": MESSAGES})
    assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert engine.submitted == []


@pytest.mark.parametrize("authorization", ["Bearer sekret", "bearer sekret", "BEARER sekret", "Bearer  sekret"])
async def test_the_auth_scheme_is_case_insensitive(engine, authorization):
    app = ServerApp(engine, manage_engine=False, api_key="sekret")
    assert (await call(app, "GET", "/v1/models", headers={"Authorization": authorization})).status == 200


@pytest.mark.parametrize("authorization", ["sekret", "Basic sekret", "Bearer sekret2", "Bearersekret", "Bearer",
                                           "Bearer sekret extra"])
async def test_other_credentials_are_refused(engine, authorization):
    app = ServerApp(engine, manage_engine=False, api_key="sekret")
    assert (await call(app, "GET", "/v1/models", headers={"Authorization": authorization})).status == 401


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/xml", "text/json"])
async def test_bodies_not_declared_json_are_415(app, engine, content_type):
    r = await call(app, "POST", CHAT, {"messages": MESSAGES}, headers={"content-type": content_type})
    assert r.status == 415 and r.json()["error"]["param"] == "content-type"
    assert engine.submitted == []


@pytest.mark.parametrize("content_type", [None, "application/json", "Application/JSON; charset=utf-8",
                                          "application/vnd.api+json"])
async def test_json_bodies_are_served(app, content_type):
    headers = {"content-type": content_type} if content_type else {}
    assert (await call(app, "POST", CHAT, {"messages": MESSAGES, "max_tokens": 1}, headers=headers)).status == 200


async def test_routes(app):
    models = (await call(app, "GET", "/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    assert (await call(app, "GET", "/v1/models/fake-model")).json()["max_model_len"] == 64
    assert (await call(app, "GET", "/v1/models/x")).status == 404
    assert (await call(app, "GET", "/nope")).status == 404
    wrong_method = await call(app, "GET", COMPLETIONS)
    assert wrong_method.status == 405 and wrong_method.headers["allow"] == "POST"  # RFC 9110
    wrong_method = await call(app, "DELETE", "/health")
    assert wrong_method.status == 405 and wrong_method.headers["allow"] == "GET"
    health = await call(app, "GET", "/health")
    assert health.status == 200 and health.json() == {"status": "serving"}
    metrics = await call(app, "GET", "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert b'metrale_requests_running{model_name="fake-model"} 0.0' in metrics.body


async def test_failure_mid_stream_is_an_error_event_then_done(app, engine):
    engine.fail_after = 2
    r = await call(app, "POST", COMPLETIONS, {"prompt": "a", "max_tokens": 5, "stream": True})
    *chunks, error, done = r.events()
    assert r.status == 200 and done == "[DONE]" and len(chunks) == 2
    assert error["error"]["type"] == "internal_error" and "boom" in error["error"]["message"]
    r = await call(app, "POST", COMPLETIONS, {"prompt": "a", "max_tokens": 5})
    assert r.status == 500 and "boom" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_aborts_the_request(engine, stream):
    engine.step_s = 0.01
    app = ServerApp(engine, manage_engine=False)
    body = {"prompt": "a", "max_tokens": 60, "stream": stream}
    if stream:
        r = await call(app, "POST", COMPLETIONS, body, disconnect_after_chunks=3)
    else:
        r = await call(app, "POST", COMPLETIONS, body, disconnect_after_s=0.05)
        assert r.status == 0  # nothing was sent
    await asyncio.sleep(0)
    assert len(engine.aborted) == 1 and engine.live == {}


@pytest.mark.parametrize("field", ["prompt", "tools", "some_unknown_field"])
async def test_deeply_nested_json_is_a_400_not_a_500(app, field):
    nested = "[" * 100_000 + "]" * 100_000
    body = '{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (field, nested)
    for path in (COMPLETIONS, CHAT):
        r = await call(app, "POST", path, body.encode())
        assert r.status == 400 and "nested" in r.json()["error"]["message"] + str(r.json()["error"]["param"]), r.body


async def test_a_chat_without_max_tokens_leaves_the_limit_to_the_engine(app, engine):
    r = await call(app, "POST", CHAT, {"messages": MESSAGES})
    assert r.status == 200 and engine.submitted[-1][1].max_tokens is None
    capped = ServerApp(engine, manage_engine=False, default_max_tokens=2)
    r = await call(capped, "POST", CHAT, {"messages": MESSAGES})
    assert r.status == 200 and engine.submitted[-1][1].max_tokens == 2


async def test_a_body_that_never_arrives_is_a_408(engine):
    app = ServerApp(engine, manage_engine=False, body_timeout_s=0.2)
    scope = {"type": "http", "method": "POST", "path": COMPLETIONS, "headers": [(b"content-length", b"100")]}
    sent = []

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 60)  # a hang guard, not a timing assert
    assert sent[0]["status"] == 408


async def test_chat_template_kwargs_reach_the_template(app, engine):
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "max_tokens": 1,
                                       "chat_template_kwargs": {"enable_thinking": False, "x": [1]}})
    assert r.status == 200, r.body
    assert engine.template_kwargs == [{"enable_thinking": False, "x": [1]}]


async def test_the_client_request_id_is_echoed_as_a_response_header(app):
    r = await call(app, "POST", CHAT, {"model": "fake-model", "messages": MESSAGES, "max_tokens": 1},
                   headers={"X-Request-Id": "client-42"})
    assert r.status == 200 and r.headers["x-request-id"] == "client-42"
    r = await call(app, "GET", "/v1/models", headers={"X-Request-Id": "client-43"})
    assert r.headers["x-request-id"] == "client-43"
    assert "x-request-id" not in (await call(app, "GET", "/v1/models")).headers


async def test_the_chat_role_goes_out_with_the_first_token_not_before(engine, app):
    """vllm bench serve's TTFT is the time to the first chunk: a role chunk sent on acceptance made it ~0."""
    engine.step_s = 0.0
    r = await call(app, "POST", CHAT, {"model": "fake-model", "messages": MESSAGES, "max_tokens": 2, "stream": True})
    first, second = r.events()[:2]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert second["choices"][0]["delta"] == {"content": "Hello"}


async def test_an_aborted_chat_stream_sends_no_role_before_its_error(engine, app):
    engine.reject = None
    engine.fail_after = 0
    r = await call(app, "POST", CHAT, {"model": "fake-model", "messages": MESSAGES, "max_tokens": 2, "stream": True})
    events = r.events()
    assert "error" in events[0] and events[-1] == "[DONE]"


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(app):
    """guidellm sends stream_options.continuous_usage_stats on every streamed request."""
    for path, body in ((CHAT, {"messages": MESSAGES}), (COMPLETIONS, {"prompt": "a b c"})):
        r = await call(app, "POST", path, {"model": "fake-model", "max_tokens": 3, "stream": True, **body,
                                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        chunks = [e for e in r.events() if e != "[DONE]"]
        completion = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
        assert completion == sorted(completion) and completion[-1] == 3
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
