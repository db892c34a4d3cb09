"""History turns with tool calls (metrale.server.tools.template_messages), in-process with a scripted engine:
malformed or absurdly nested `arguments` are a 400 naming the turn, never a 500."""

from __future__ import annotations

import json

import pytest

from metrale.server.app import ServerApp
from metrale.server.tools import MAX_ARGUMENTS_DEPTH
from tests.server.fakes import FakeEngine, call

CHAT = "/v1/chat/completions"


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
