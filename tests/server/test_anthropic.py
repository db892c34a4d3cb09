"""The Anthropic Messages API (metrale.server.anthropic), in process: the official `anthropic` client over an ASGI
transport against the server app with a scripted engine, and the request translation on its own.

The same client against a real `metrale serve` (tool use round trips, token counts) is test_anthropic_client.py.
"""

from __future__ import annotations

import json

import anthropic
import httpx2
import msgspec
import pytest

from metrale.server import anthropic_protocol as ap
from metrale.server.app import ServerApp
from metrale.server.errors import APIError
from tests.server.fakes import FakeEngine, WordEngine, call


@pytest.fixture
def engine() -> FakeEngine:
    return WordEngine()


def client_for(app: ServerApp, api_key: str = "unused") -> anthropic.AsyncAnthropic:
    transport = httpx2.ASGITransport(app=app)
    return anthropic.AsyncAnthropic(base_url="http://localhost", api_key=api_key, max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=transport, base_url="http://localhost"))


async def test_a_message_has_anthropic_shape(engine):
    async with client_for(ServerApp(engine, manage_engine=False)) as client:
        message = await client.messages.create(model="fake-model", max_tokens=3, system="be brief",
                                               messages=[{"role": "user", "content": "hi there"}])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == "fake-model"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "Hello world!"
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 3 and message.usage.input_tokens == 4  # "be brief hi there"
    assert engine.submitted[0][1].max_tokens == 3


async def test_a_streamed_message_sends_anthropic_events_in_order(engine):
    async with client_for(ServerApp(engine, manage_engine=False)) as client:
        stream = await client.messages.create(model="fake-model", max_tokens=4, stream=True,
                                              messages=[{"role": "user", "content": "hi"}])
        events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * 4, "content_block_stop",
                     "message_delta", "message_stop"]
    assert events[0].message.usage.input_tokens == 1 and events[0].message.content == []
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "Hello world! How"
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 4


async def test_the_stream_helper_assembles_the_final_message(engine):
    async with client_for(ServerApp(engine, manage_engine=False)) as client:
        async with client.messages.stream(model="fake-model", max_tokens=2,
                                          messages=[{"role": "user", "content": "hi"}]) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
    assert text == "Hello world" == final.content[0].text and final.stop_reason == "max_tokens"


async def test_sampling_fields_reach_the_engine(engine):
    async with client_for(ServerApp(engine, manage_engine=False)) as client:
        await client.messages.create(model="fake-model", max_tokens=2, stop_sequences=["END"],
                                     extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7},  # older clients
                                     thinking={"type": "adaptive"}, output_config={"effort": "low"},
                                     messages=[{"role": "user", "content": "hi"}])
    params = engine.submitted[0][1]
    assert (params.temperature, params.top_p, params.top_k, tuple(params.stop)) == (0.5, 0.9, 7, ("END",))
    assert engine.template_kwargs[-1] == {"enable_thinking": True, "reasoning_effort": "low"}


async def test_an_output_format_is_a_json_schema_constraint(engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    async with client_for(ServerApp(engine, manage_engine=False)) as client:
        await client.messages.create(model="fake-model", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(engine.submitted[0][1].structured_outputs.json) == schema


async def test_the_api_key_is_taken_from_x_api_key():
    app = ServerApp(WordEngine(), manage_engine=False, api_key="sekret")
    async with client_for(app, api_key="sekret") as client:
        message = await client.messages.create(model="fake-model", max_tokens=1,
                                               messages=[{"role": "user", "content": "hi"}])
    assert message.content[0].text == "Hello"
    async with client_for(app, api_key="wrong") as client:
        with pytest.raises(anthropic.AuthenticationError):
            await client.messages.create(model="fake-model", max_tokens=1, messages=[{"role": "user", "content": "x"}])


async def test_count_tokens(engine):
    async with client_for(ServerApp(engine, manage_engine=False)) as client:
        counted = await client.messages.count_tokens(model="fake-model", system="a b",
                                                     messages=[{"role": "user", "content": "c d e"}])
    assert counted.input_tokens == 5  # the fake tokenizes into words; nothing is generated
    assert engine.submitted == []


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "fake-model", "max_tokens": 1, "messages": []}, "messages"),
    ({"model": "fake-model", "max_tokens": 1, "messages": [{"role": "system", "content": "hi"}]}, "role"),
    ({"model": "fake-model", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "image"),
    ({"model": "fake-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
    ({"model": "fake-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"model": "fake-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
      "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
])
async def test_bad_requests_are_anthropic_400s(engine, body, field):
    response = await call(ServerApp(engine, manage_engine=False), "POST", "/v1/messages", body)
    assert response.status == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"]
    assert engine.submitted == []


async def test_an_unknown_model_is_a_404_not_found_error(engine):
    response = await call(ServerApp(engine, manage_engine=False), "POST", "/v1/messages",
                          {"model": "other", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status == 404 and response.json()["error"]["type"] == "not_found_error"


async def test_a_failure_mid_stream_is_an_error_event(engine):
    engine.fail_after = 2
    response = await call(ServerApp(engine, manage_engine=False), "POST", "/v1/messages",
                          {"model": "fake-model", "max_tokens": 5, "stream": True,
                           "messages": [{"role": "user", "content": "hi"}]})
    events = [chunk for chunk in response.body.decode().split("\n\n") if chunk]
    assert events[0].startswith("event: message_start")
    assert events[-1].startswith("event: error") and '"api_error"' in events[-1]
    assert not any(e.startswith("event: message_stop") for e in events)


def test_tool_turns_translate_into_chat_messages():
    request = msgspec.convert({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "sys"}],
        "tools": [{"name": "get_weather", "description": "weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                              {"type": "text", "text": "Let me check."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "12 C"}]},
                                         {"type": "text", "text": "And tomorrow?"}]},
        ]}, ap.MessagesRequest)
    chat = ap.to_chat_request(request)
    assert msgspec.to_builtins(chat.messages) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                                                            "description": "weather"}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False and chat.max_tokens == 5
    assert chat.chat_template_kwargs == {"enable_thinking": False}


def test_a_failed_tool_result_says_so():
    request = msgspec.convert({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "no such city",
                                      "is_error": True}]}]}, ap.MessagesRequest)
    assert msgspec.to_builtins(ap.to_chat_request(request).messages) == [
        {"role": "tool", "content": "Error: no such city", "tool_call_id": "t"}]


def test_tool_choice_any_needs_tools():
    request = msgspec.convert({"model": "m", "max_tokens": 1, "tool_choice": {"type": "any"},
                               "messages": [{"role": "user", "content": "x"}]}, ap.MessagesRequest)
    with pytest.raises(APIError, match="needs tools"):
        ap.to_chat_request(request)


CALL_WORDS = ("Sure.", "<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}', "\n</tool_call>")
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]


async def test_a_parsed_tool_call_is_a_tool_use_block_streamed_and_not():
    engine = WordEngine(words=CALL_WORDS)
    engine.tool_call_format = "hermes"
    kwargs = dict(model="fake-model", max_tokens=len(CALL_WORDS), tools=TOOLS,
                  messages=[{"role": "user", "content": "weather?"}])
    async with client_for(ServerApp(engine, manage_engine=False)) as client:
        full = await client.messages.create(**kwargs)
        async with client.messages.stream(**kwargs) as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_message()
    for message in (full, streamed):
        assert [b.type for b in message.content] == ["text", "tool_use"]
        assert message.content[0].text.strip() == "Sure."
        assert (message.content[1].name, message.content[1].input) == ("get_weather", {"city": "Oslo"})
        assert message.stop_reason == "tool_use"
    assert kinds.count("content_block_start") == 2 and kinds.count("content_block_stop") == 2


THINKING = ("<think>", "\nAdd", " them.\n", "</think>", "\n\n", "It is", " 4.")


async def test_reasoning_is_a_thinking_block_first_streamed_and_not():
    engine = WordEngine(words=THINKING)
    engine.reasoning_format = "think"
    kwargs = dict(model="fake-model", max_tokens=len(THINKING), messages=[{"role": "user", "content": "2+2?"}])
    async with client_for(ServerApp(engine, manage_engine=False)) as client:
        full = await client.messages.create(**kwargs)
        async with client.messages.stream(**kwargs) as stream:
            deltas = [event.delta.type async for event in stream if event.type == "content_block_delta"]
            streamed = await stream.get_final_message()
    for message in (full, streamed):
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert (message.content[0].thinking, message.content[1].text.strip()) == ("\nAdd them.\n", "It is 4.")
    assert set(deltas) == {"thinking_delta", "text_delta"}
    async with client_for(ServerApp(engine, manage_engine=False, reasoning_parser="none")) as client:
        plain = await client.messages.create(**kwargs)
    assert [b.type for b in plain.content] == ["text"] and "<think>" in plain.content[0].text
