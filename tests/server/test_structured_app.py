"""The request fields of structured outputs, token masks and tools, mapped onto the engine's arguments
(in-process, scripted engine): what reaches SamplingParams, what is a 400 naming its field, and the
shape of tool-call responses, streamed and not."""

from __future__ import annotations

import json

import pytest

from metrale.errors import InvalidStructuredOutputError
from metrale.server.app import ServerApp
from metrale.structured_outputs import MAX_CONSTRAINT_CHARS, StructuredOutputs
from tests.metrale.test_structured_outputs import ref_chain, rule_chain, wide_object
from tests.server.fakes import FakeEngine, call

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi there"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL_WORDS = ("Sure", "<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"city": ', '"Oslo"}}',
              "\n</tool_call>")


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def app(engine: FakeEngine) -> ServerApp:
    return ServerApp(engine, manage_engine=False)


@pytest.mark.parametrize(("path", "fields", "expected"), [
    (CHAT, {"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutputs(json=SCHEMA)),
    (COMPLETIONS, {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     StructuredOutputs(json=SCHEMA)),
    (COMPLETIONS, {"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputs(regex="[0-9]+")),
    (CHAT, {"guided_json": json.dumps(SCHEMA)}, StructuredOutputs(json=SCHEMA)),
    (COMPLETIONS, {"guided_regex": "a|b"}, StructuredOutputs(regex="a|b")),
    (CHAT, {"guided_choice": ["yes", "no"]}, StructuredOutputs(choice=["yes", "no"])),
    (COMPLETIONS, {"guided_grammar": 'root ::= "x"'}, StructuredOutputs(grammar='root ::= "x"')),
    (CHAT, {"response_format": {"type": "text"}}, None),
])
async def test_constraint_fields_reach_the_params_and_are_prepared(app, engine, path, fields, expected):
    body = {"messages": MESSAGES} if path == CHAT else {"prompt": "a b"}
    r = await call(app, "POST", path, {**body, "max_tokens": 2, **fields})
    assert r.status == 200, r.body
    (_, params), = engine.submitted
    assert params.structured_outputs == expected and engine.prepared == [params]


async def test_token_mask_fields_reach_the_params(app, engine):
    r = await call(app, "POST", COMPLETIONS, {"prompt": "a", "max_tokens": 2, "logit_bias": {"17": 100, "3": -5.5},
                                              "allowed_token_ids": [3, 17, 20], "bad_words": ["darn"]})
    assert r.status == 200, r.body
    (_, params), = engine.submitted
    assert params.logit_bias == {17: 100.0, 3: -5.5} and params.allowed_token_ids == (3, 17, 20)
    assert params.bad_words == ("darn",)


@pytest.mark.parametrize(("path", "fields", "param", "words"), [
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format", "schema"),
    (CHAT, {"response_format": {"type": "yaml"}}, "response_format", "json_object"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    (COMPLETIONS, {"guided_choice": []}, "guided_choice", "non-empty"),
    (COMPLETIONS, {"guided_json": "{nope"}, "guided_json", "not JSON"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", "exactly one"),
    (COMPLETIONS, {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    (COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    (COMPLETIONS, {"allowed_token_ids": []}, "allowed_token_ids", "at least one"),
    (COMPLETIONS, {"bad_words": [""]}, "bad_words", "non-empty"),
    (CHAT, {"tool_choice": "required"}, "tool_choice", "needs tools"),
    (CHAT, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    (CHAT, {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    (CHAT, {"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "twice"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tool_choice": "required"},
     "tools", "parameters"),
    (CHAT, {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "messages", "not JSON"),
])
async def test_bad_fields_are_a_400_naming_them(app, engine, path, fields, param, words):
    body = {"messages": MESSAGES} if path == CHAT else {"prompt": "a b"}
    r = await call(app, "POST", path, {**body, **fields})
    assert r.status == 400, r.body
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert engine.submitted == []


def _chain_tool(links: int) -> dict:
    return {"type": "function", "function": {"name": "deep", "parameters": ref_chain(links)}}


@pytest.mark.parametrize(("path", "fields", "param", "words"), [
    # each of these crashed the server (SIGSEGV in llguidance) or could never run: a 400 before compiling
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": ref_chain(5000)}}},
     "response_format", 'response_format.json_schema.schema must hold at most 1024 "$ref"'),
    (COMPLETIONS, {"guided_json": ref_chain(5000)}, "guided_json", '"$ref"'),
    (COMPLETIONS, {"guided_grammar": rule_chain(5000)}, "guided_grammar", "guided_grammar must define at most 1024"),
    (COMPLETIONS, {"structured_outputs": {"grammar": rule_chain(5000, gbnf=True)}}, "structured_outputs", "rules"),
    (COMPLETIONS, {"guided_choice": [str(i) for i in range(2001)]}, "guided_choice",
     "guided_choice must hold at most 1024 strings"),
    (COMPLETIONS, {"guided_regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "guided_regex", "characters"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": wide_object(499)}}}, "response_format",
     "response_format.json_schema.schema: an object may have at most 450 optional properties"),  # was a 500
    (CHAT, {"tools": [_chain_tool(5000)], "tool_choice": "required"}, "tools", 'tools: must hold at most 1024 "$ref"'),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "wide", "parameters": wide_object(451)}}],
            "tool_choice": "required"}, "tools", "tools: an object may have at most 450 optional properties"),
    (CHAT, {"tools": [_chain_tool(5000)], "tool_choice": {"type": "function", "function": {"name": "deep"}}}, "tools",
     '"$ref"'),
    # 100,000 bad words stalled every stream 3.8 s; 4 x 150,000 stop strings took a bystander from 2.9 s to 85 s
    (COMPLETIONS, {"bad_words": [f"w{i}" for i in range(100_000)]}, "bad_words", "bad_words must hold at most 128"),
    (CHAT, {"stop": [f"s{i}" for i in range(150_000)]}, "stop", "stop must hold at most 128 strings, got 150000"),
    (COMPLETIONS, {"stop": ["s" * 10_000]}, "stop", "at most 8192 characters in all"),
])
async def test_fields_past_their_bounds_are_a_400_before_any_work(app, engine, path, fields, param, words):
    body = {"messages": MESSAGES} if path == CHAT else {"prompt": "a b"}
    r = await call(app, "POST", path, {**body, **fields})
    assert r.status == 400, r.body
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert engine.submitted == [] and engine.prepared == []


async def test_a_schema_the_engine_refuses_is_a_400_named_after_its_field(app, engine):
    async def refuse(params):
        raise InvalidStructuredOutputError("structured_outputs.json: Invalid type: foo")

    engine.prepare = refuse
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}})
    assert r.status == 400
    assert r.json()["error"] == {"message": "response_format: Invalid type: foo", "type": "invalid_request_error",
                                 "param": "response_format", "code": "invalid_structured_output"}
    assert engine.submitted == []


async def test_required_and_named_tool_choice_become_constraints(app, engine):
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required",
                                       "parallel_tool_calls": False, "max_tokens": 2})
    assert r.status == 200, r.body
    schema = json.loads(engine.submitted[-1][1].structured_outputs.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    (variant,) = schema["items"]["anyOf"]
    assert variant["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert variant["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert engine.chat_tools[-1] == [WEATHER]
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 2,
                                       "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert r.status == 200, r.body
    assert json.loads(engine.submitted[-1][1].structured_outputs.json) == WEATHER["function"]["parameters"]
    message = r.json()["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": "Hello world"}  # the fake's words, as the arguments


async def test_none_leaves_the_tools_out_and_history_arguments_are_decoded(app, engine):
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    r = await call(app, "POST", CHAT, {"messages": history, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 2})
    assert r.status == 200, r.body
    assert engine.chat_tools[-1] is None and engine.submitted[-1][1].structured_outputs is None
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}


async def test_auto_parses_the_models_tool_calls_streamed_and_not():
    engine = FakeEngine(words=CALL_WORDS)
    engine.tool_call_format = "hermes"
    app = ServerApp(engine, manage_engine=False)
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": len(CALL_WORDS)}
    r = await call(app, "POST", CHAT, body)
    assert r.status == 200, r.body
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "Sure" and len(message["tool_calls"]) == 1
    (tool_call,) = message["tool_calls"]
    assert tool_call["id"].startswith("call_") and tool_call["type"] == "function"
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    r = await call(app, "POST", CHAT, {**body, "stream": True})
    *chunks, done = r.events()
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure"
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert all(set(tc) == {"index", "function"} for tc in calls[1:])
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Oslo"}'
    assert engine.chat_tools[-1] == [WEATHER]
