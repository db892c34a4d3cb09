"""metrale.server.tools: history messages for the template (Mistral's 9-character call ids), and malformed or
absurdly nested tool-call `arguments` in history turns: a 400 naming the turn, never a 500 (in-process, a
scripted engine)."""

from __future__ import annotations

import json

import pytest

from metrale.server.app import ServerApp
from metrale.server.tools import MAX_ARGUMENTS_DEPTH, mistral_id, template_messages
from metrale.text.chat_template import ChatTemplate
from tests.llamacpp_assets import template_path
from tests.server.fakes import FakeEngine, call

CHAT = "/v1/chat/completions"

HISTORY = [{"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_0123456789abcdef01234567", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
           {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "12 C"}]


def test_mistral_templates_get_stable_nine_character_ids():
    short = mistral_id("call_0123456789abcdef01234567")
    assert len(short) == 9 and short.isalnum() and short == mistral_id("call_0123456789abcdef01234567")
    assert mistral_id("ab12CD34e") == "ab12CD34e"
    messages = template_messages(HISTORY, None, "mistral")
    assert messages[1]["tool_calls"][0]["id"] == messages[2]["tool_call_id"] == short
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    nemo = ChatTemplate(template_path("mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text(encoding="utf-8"))
    assert f'"id": "{short}"' in nemo.render(messages)
    assert template_messages(HISTORY, None, "hermes")[2]["tool_call_id"] == "call_0123456789abcdef01234567"


def history(arguments: object) -> list[dict]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("arguments", [
    nested(100_000),                                   # RecursionError in json.loads: was a 500
    '{"a": ' + nested(MAX_ARGUMENTS_DEPTH) + "}",      # parses, but the template's tojson would recurse
    json.loads(nested(MAX_ARGUMENTS_DEPTH + 1)),       # the same as an object instead of a string
    "{not json",
])
async def test_bad_arguments_in_history_are_a_400(arguments):
    engine = FakeEngine()
    r = await call(ServerApp(engine, manage_engine=False), "POST", CHAT, {"messages": history(arguments)})
    assert r.status == 400, r.body
    error = r.json()["error"]
    assert error["param"] == "messages" and "messages[1].tool_calls[0].function.arguments" in error["message"]
    assert engine.submitted == []  # nothing reached the engine


@pytest.mark.parametrize("arguments", ['{"a": ' + nested(MAX_ARGUMENTS_DEPTH - 1) + "}", "", {"city": "Oslo"}])
async def test_reasonable_arguments_in_history_are_served(arguments):
    r = await call(ServerApp(FakeEngine(), manage_engine=False), "POST", CHAT, {"messages": history(arguments)})
    assert r.status == 200, r.body
