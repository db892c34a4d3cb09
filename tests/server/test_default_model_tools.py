"""Out of the box, with the real default model (SmolLM2-135M-Instruct, whose template knows no tool format):
`tools` without `tool_choice` through the openai client gives a valid call or a text answer (the generic
format), greedy, streamed and not."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.serve import ServerProcess

pytest.importorskip("llguidance")
pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}


def test_tools_out_of_the_box_on_the_default_model():
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with ServerProcess("--kv-cache-mib", "64") as server:
        with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120) as client:
            (card,) = client.models.list().data
            out = client.chat.completions.create(model=card.id, messages=messages, tools=[WEATHER],
                                                 temperature=0, max_tokens=120)
            (choice,) = out.choices
            message = choice.message
            if message.tool_calls:
                for call in message.tool_calls:
                    assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
                    assert set(json.loads(call.function.arguments)) == {"city"}
            else:
                assert message.content and choice.finish_reason in ("stop", "length")
            chunks = list(client.chat.completions.create(model=card.id, messages=messages, tools=[WEATHER],
                                                         temperature=0, max_tokens=120, stream=True))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            if message.tool_calls:
                streamed = "".join(tc.function.arguments or "" for d in deltas for tc in d.tool_calls or [])
                assert streamed == "".join(call.function.arguments for call in message.tool_calls)
            else:
                assert "".join(d.content or "" for d in deltas) == message.content
