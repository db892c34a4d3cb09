"""Ollama's API (metrale.server.ollama), in process: the official `ollama` client over an ASGI transport against the
server app with a scripted engine, and the request translation on its own.

The same client against a real `metrale serve` (tools, format, the default model's answers) is
test_ollama_client.py.
"""

from __future__ import annotations

import json

import httpx
import msgspec
import ollama
import pytest

from metrale.server import ollama_protocol as op
from metrale.server.app import ServerApp
from metrale.server.errors import APIError
from tests.server.fakes import FakeEngine, WordEngine, call


@pytest.fixture
def engine() -> FakeEngine:
    return WordEngine()


def client_for(app: ServerApp, **kwargs) -> ollama.AsyncClient:
    return ollama.AsyncClient(host="http://localhost", transport=httpx.ASGITransport(app=app), **kwargs)


async def test_chat_answers_in_ollama_shape(engine):
    client = client_for(ServerApp(engine, manage_engine=False))
    response = await client.chat(model="fake-model", messages=[{"role": "user", "content": "hi there"}],
                                 options={"num_predict": 3, "temperature": 0.2, "top_k": 5, "repeat_penalty": 1.1,
                                          "stop": ["END"], "num_ctx": 4096, "seed": 7})
    assert response.message.role == "assistant" and response.message.content == "Hello world!"
    assert response.done and response.done_reason == "length"
    assert response.prompt_eval_count == 2 and response.eval_count == 3 and response.total_duration > 0
    params = engine.submitted[0][1]
    assert (params.max_tokens, params.temperature, params.top_k, params.repetition_penalty, params.seed) == \
        (3, 0.2, 5, 1.1, 7) and tuple(params.stop) == ("END",)


async def test_chat_streams_ndjson_until_done(engine):
    client = client_for(ServerApp(engine, manage_engine=False))
    parts = [part async for part in await client.chat(model="fake-model:latest", stream=True,
                                                      messages=[{"role": "user", "content": "hi"}],
                                                      options={"num_predict": 4})]
    assert "".join(p.message.content for p in parts) == "Hello world! How"
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 4


async def test_generate_renders_the_prompt_and_raw_does_not(engine):
    client = client_for(ServerApp(engine, manage_engine=False))
    response = await client.generate(model="fake-model", prompt="tell me", system="be kind",
                                     options={"num_predict": 2})
    assert response.response == "Hello world" and response.done and response.prompt_eval_count == 4
    raw = await client.generate(model="fake-model", prompt="a b c", raw=True, options={"num_predict": 1})
    assert raw.response == "Hello" and engine.submitted[-1][0] == "a b c"  # the prompt itself, no template


async def test_unlimited_num_predict_asks_for_the_rest_of_the_context(engine):
    client = client_for(ServerApp(engine, manage_engine=False))
    await client.generate(model="fake-model", prompt="x", options={"num_predict": -1})
    await client.generate(model="fake-model", prompt="x", raw=True)
    assert [params.max_tokens for _, params in engine.submitted] == [None, None]


async def test_format_and_think_reach_the_engine(engine):
    client = client_for(ServerApp(engine, manage_engine=False))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    await client.chat(model="fake-model", messages=[{"role": "user", "content": "x"}], format=schema, think="low",
                      options={"num_predict": 1})
    await client.chat(model="fake-model", messages=[{"role": "user", "content": "x"}], format="json",
                      options={"num_predict": 1})
    first, second = (params.structured_outputs for _, params in engine.submitted)
    assert json.loads(first.json) == schema and second.json_object
    assert engine.template_kwargs[0] == {"enable_thinking": True, "reasoning_effort": "low"}


async def test_listing_and_showing_the_model(engine):
    client = client_for(ServerApp(engine, manage_engine=False))
    (model,) = (await client.list()).models
    assert model.model == "fake-model" and model.details.family == "llama" and model.details.format == "gguf"
    (running,) = (await client.ps()).models
    assert running.model == "fake-model" and running.context_length == engine.max_model_len
    shown = await client.show("fake-model")
    assert "completion" in shown.capabilities and shown.modelinfo["llama.context_length"] == engine.max_model_len
    with pytest.raises(ollama.ResponseError) as error:
        await client.show("other-model")
    assert error.value.status_code == 404 and "other-model" in error.value.error


async def test_root_and_version_answer_like_ollama(engine):
    app = ServerApp(engine, manage_engine=False)
    root = await call(app, "GET", "/")
    assert root.status == 200 and root.body == b"Ollama is running"
    assert (await call(app, "GET", "/api/version")).json()["version"]


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/api/chat", {"model": "fake-model", "messages": []}, 400, "messages"),
    ("/api/chat", {"model": "fake-model", "messages": [{"role": "user", "content": "x"}],
                   "options": {"mirostat": 2}}, 400, "mirostat"),
    ("/api/chat", {"model": "fake-model", "messages": [{"role": "user", "content": "x"}],
                   "options": {"no_such_option": 1}}, 400, "no_such_option"),
    ("/api/chat", {"model": "fake-model", "messages": [{"role": "user", "content": "x", "images": ["AA=="]}]},
     400, "images"),
    ("/api/generate", {"model": "fake-model", "prompt": "x", "context": [1, 2]}, 400, "context"),
    ("/api/generate", {"model": "nope", "prompt": "x"}, 404, "nope"),
    ("/api/embed", {"model": "fake-model", "input": "x"}, 400, "--task embed"),
    ("/api/pull", {"model": "llama3"}, 400, "not supported"),
    ("/api/nothing", {}, 404, "no route"),
])
async def test_refusals_are_ollama_error_bodies(engine, path, body, status, words):
    response = await call(ServerApp(engine, manage_engine=False), "POST", path, body)
    assert response.status == status and words in response.json()["error"]
    assert engine.submitted == []


async def test_tool_turns_translate_into_chat_messages():
    request = msgspec.convert({"model": "m:latest", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "12 C", "tool_name": "get_weather"}]}, op.ChatRequest)
    chat = op.chat_request(request)
    assert chat.model == "m" and chat.stream is True
    assert msgspec.to_builtins(chat.messages) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "12 C", "name": "get_weather"}]


def test_bad_think_and_format_values_are_refused():
    with pytest.raises(APIError, match="think"):
        op.chat_request(msgspec.convert({"model": "m", "think": "max", "messages": [{"role": "user", "content": "x"}]},
                                        op.ChatRequest))
    with pytest.raises(APIError, match="format"):
        op.chat_request(msgspec.convert({"model": "m", "format": "xml", "messages": [{"role": "user", "content": "x"}]},
                                        op.ChatRequest))


CALL_WORDS = ("Sure.", "<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}', "\n</tool_call>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_call_in_the_answer_is_a_whole_ollama_tool_call(stream):
    engine = WordEngine(words=CALL_WORDS)
    engine.tool_call_format = "hermes"
    client = client_for(ServerApp(engine, manage_engine=False))
    kwargs = dict(model="fake-model", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                  options={"num_predict": len(CALL_WORDS)})
    if stream:
        parts = [part async for part in await client.chat(stream=True, **kwargs)]
    else:
        parts = [await client.chat(**kwargs)]
    calls = [call for part in parts for call in part.message.tool_calls or ()]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert "".join(p.message.content for p in parts).strip() == "Sure."


THINKING = ("<think>", "\nAdd", " them.\n", "</think>", "\n\n", "It is", " 4.")


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_is_message_thinking(stream):
    engine = WordEngine(words=THINKING)
    engine.reasoning_format = "think"
    client = client_for(ServerApp(engine, manage_engine=False))
    kwargs = dict(model="fake-model", messages=[{"role": "user", "content": "2+2?"}],
                  options={"num_predict": len(THINKING)})
    parts = [p async for p in await client.chat(stream=True, **kwargs)] if stream else [await client.chat(**kwargs)]
    assert "".join(p.message.thinking or "" for p in parts) == "\nAdd them.\n"
    assert "".join(p.message.content for p in parts).strip() == "It is 4."
    generated = await client.generate(model="fake-model", prompt="2+2?", options={"num_predict": len(THINKING)})
    assert (generated.thinking, generated.response.strip()) == ("\nAdd them.\n", "It is 4.")


async def test_a_wrong_method_is_a_405_naming_the_right_one(engine):
    app = ServerApp(engine, manage_engine=False)
    wrong_get = await call(app, "GET", "/api/chat")
    wrong_post = await call(app, "POST", "/api/tags", {})
    assert (wrong_get.status, wrong_get.headers.get("allow")) == (405, "POST")
    assert (wrong_post.status, wrong_post.headers.get("allow")) == (405, "GET")
    root = await call(app, "POST", "/", {})
    assert (root.status, root.headers.get("allow")) == (405, "GET, HEAD")
