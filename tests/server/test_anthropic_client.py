"""The official `anthropic` client against a real `metrale serve` of a tiny random model with a Hermes-style tool
template (the model of test_tools_openai.py): tool use forced by tool_choice, streamed and not, and a round trip
whose rendered prompt equals what the OpenAI route renders for the same conversation."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.server.test_tools_openai import MESSAGES, PARAMETERS, model_path  # noqa: F401 (a fixture)
from tests.server.serve import ServerProcess

pytest.importorskip("llguidance")
pytestmark = pytest.mark.timeout(300)

TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": PARAMETERS},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]
FORCE_WEATHER = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(model_path):  # noqa: F811
    with ServerProcess("--model", str(model_path), "--max-model-len", "2048", "--kv-cache-mib", "32") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url(""), api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_a_forced_tool_is_a_tool_use_block(client):
    message = client.messages.create(model="tiny-tools", max_tokens=300, messages=MESSAGES, tools=TOOLS,
                                     tool_choice=FORCE_WEATHER)
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    jsonschema.validate(block.input, PARAMETERS)
    assert message.stop_reason == "tool_use"
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == client.messages.count_tokens(
        model="tiny-tools", messages=MESSAGES, tools=TOOLS, tool_choice=FORCE_WEATHER).input_tokens


def test_a_streamed_tool_use_assembles_into_the_same_call(client):
    full = client.messages.create(model="tiny-tools", max_tokens=300, messages=MESSAGES, tools=TOOLS,
                                  tool_choice=FORCE_WEATHER, extra_body={"temperature": 0})
    with client.messages.stream(model="tiny-tools", max_tokens=300, messages=MESSAGES, tools=TOOLS,
                                tool_choice=FORCE_WEATHER, extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in full.content]


def test_a_round_trip_renders_the_conversation_as_the_openai_route_does(client, server):
    first = client.messages.create(model="tiny-tools", max_tokens=300, messages=MESSAGES, tools=TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (call,) = [b for b in first.content if b.type == "tool_use"]
    history = [*MESSAGES, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": '{"temperature": 12}'}]}]
    second = client.messages.create(model="tiny-tools", max_tokens=4, messages=history, tools=TOOLS,
                                    tool_choice={"type": "none"})
    assert second.usage.output_tokens <= 4 and second.stop_reason in ("end_turn", "max_tokens")
    openai_history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 12}'}]
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120) as oa:
        same = oa.chat.completions.create(model="tiny-tools", messages=openai_history, max_tokens=1,
                                          tools=[{"type": "function", "function": {"name": t["name"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS],
                                          tool_choice="none")
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == same.usage.prompt_tokens


def test_errors_are_typed_for_the_client(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="another-model", max_tokens=4, messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model="tiny-tools", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])

