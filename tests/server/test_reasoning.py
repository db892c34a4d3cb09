"""Reasoning and the generic tool format on /v1/chat/completions and /v1/responses (in-process, scripted
engine): <think> text becomes reasoning_content (its own deltas when streamed) and a Responses reasoning
item; reasoning_effort and chat_template_kwargs reach the template; include_reasoning: false drops it."""

from __future__ import annotations

import json

from metrale.server.app import ServerApp
from tests.server.fakes import FakeEngine, call

CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
MESSAGES = [{"role": "user", "content": "2+2?"}]
THINKING = ("<think>", "\nAdd", " them.\n", "</think>", "\n\n", "It is", " 4.")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def thinking_app(words=THINKING, **options) -> tuple[FakeEngine, ServerApp]:
    engine = FakeEngine(words=words)
    engine.reasoning_format = "think"
    return engine, ServerApp(engine, manage_engine=False, **options)


async def test_reasoning_is_split_into_reasoning_content_streamed_and_not():
    engine, app = thinking_app()
    body = {"messages": MESSAGES, "max_tokens": len(THINKING)}
    r = await call(app, "POST", CHAT, body)
    assert r.status == 200, r.body
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("\nAdd them.\n", "It is 4.")
    r = await call(app, "POST", CHAT, {**body, "stream": True})
    *chunks, done = r.events()
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nAdd them.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    assert not any("reasoning_content" in d and d.get("content") for d in deltas)  # separate deltas


async def test_include_reasoning_false_and_reasoning_parser_none_keep_it_out():
    engine, app = thinking_app()
    body = {"messages": MESSAGES, "max_tokens": len(THINKING)}
    r = await call(app, "POST", CHAT, {**body, "include_reasoning": False})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is 4."}
    engine, app = thinking_app(reasoning_parser="none")
    r = await call(app, "POST", CHAT, body)
    assert r.json()["choices"][0]["message"]["content"] == "".join(THINKING)


async def test_reasoning_effort_and_template_kwargs_reach_the_template():
    engine, app = thinking_app()
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "max_tokens": 2, "reasoning_effort": "high"})
    assert r.status == 200, r.body
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "max_tokens": 2, "reasoning_effort": "none"})
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "max_tokens": 2,
                                       "chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "none"})
    r = await call(app, "POST", RESPONSES, {"input": "2+2?", "max_output_tokens": 2, "reasoning": {"effort": "low"}})
    assert r.status == 200, r.body
    assert engine.template_kwargs == [{"reasoning_effort": "high"},
                                      {"reasoning_effort": "none", "enable_thinking": False},
                                      {"reasoning_effort": "none", "enable_thinking": True},
                                      {"reasoning_effort": "low"}]
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "reasoning_effort": "extreme"})
    assert r.status == 400 and r.json()["error"]["param"] == "reasoning_effort"


async def test_responses_put_reasoning_in_a_reasoning_item_streamed_and_not():
    engine, app = thinking_app()
    body = {"input": "2+2?", "max_output_tokens": len(THINKING)}
    r = await call(app, "POST", RESPONSES, body)
    output = r.json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "\nAdd them.\n"}]
    assert output[1]["content"][0]["text"] == "It is 4."
    r = await call(app, "POST", RESPONSES, {**body, "stream": True})
    events = [json.loads(part.split("data: ", 1)[1]) for part in r.body.decode().split("\n\n") if part]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "\nAdd them.\n"
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]


GENERIC_CALL = ('{"tool_call": {"name": "get_weather", ', '"arguments": {"city": "Oslo"}}}')


async def test_tools_without_a_template_format_use_the_generic_grammar_and_answer():
    engine = FakeEngine(words=GENERIC_CALL)  # tool_call_format None: the template shows no format
    app = ServerApp(engine, manage_engine=False)
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 2})
    assert r.status == 200, r.body
    choice = r.json()["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert choice["finish_reason"] == "length"
    (_, params), = engine.submitted
    schema = json.loads(params.structured_outputs.json)
    assert [set(v["properties"]) for v in schema["anyOf"]] == [{"tool_calls"}, {"response"}]
    assert engine.prepared == [params]
    engine = FakeEngine(words=('{"response": "Hi \\u00e9', '\\n"}'))
    app = ServerApp(engine, manage_engine=False)
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 2, "stream": True})
    *chunks, done = r.events()
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Hi é\n"


async def test_the_generic_instructions_go_into_the_system_message():
    engine = FakeEngine(words=GENERIC_CALL)
    app = ServerApp(engine, manage_engine=False)
    system = {"role": "system", "content": "Be brief."}
    r = await call(app, "POST", CHAT, {"messages": [system, *MESSAGES], "tools": [WEATHER], "max_tokens": 2,
                                       "parallel_tool_calls": False})
    assert r.status == 200, r.body
    (prompt, params), = engine.submitted
    assert prompt.startswith("You can call these tools:") and "Be brief." in prompt and "get_weather" in prompt
    assert set(json.loads(params.structured_outputs.json)["anyOf"][0]["properties"]) == {"tool_call"}
    assert json.loads(r.body)["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


async def test_reasoning_given_back_reaches_the_template():
    engine, app = thinking_app()
    seen = []
    render = engine.chat_token_ids

    async def recording(messages, tools=None, **kwargs):
        seen.append([m.get("reasoning_content") for m in messages])
        return await render(messages, tools, **kwargs)

    engine.chat_token_ids = recording
    history = [*MESSAGES, {"role": "assistant", "content": "4.", "reasoning_content": "Add them."},
               {"role": "user", "content": "And 3+3?"}]
    r = await call(app, "POST", CHAT, {"messages": history, "max_tokens": 2})
    assert r.status == 200, r.body
    r = await call(app, "POST", RESPONSES, {"input": [
        {"role": "user", "content": "2+2?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Add."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4."}]},
        {"role": "user", "content": "3+3?"}], "max_output_tokens": 2})
    assert r.status == 200, r.body
    assert seen == [[None, "Add them.", None], [None, "Add.", None]]
    r = await call(app, "POST", RESPONSES, {"input": [{"type": "reasoning", "content": "x"}], "max_output_tokens": 2})
    assert r.status == 400 and r.json()["error"]["param"] == "input"


async def test_the_generic_format_takes_response_format_as_the_response_schema():
    engine = FakeEngine(words=('{"response": ', '{"a": 1}}'))
    app = ServerApp(engine, manage_engine=False)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": '{"a": 1}'}
    (_, params), = engine.submitted
    assert json.loads(params.structured_outputs.json)["anyOf"][1]["properties"]["response"] == schema
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "tools": [WEATHER], "guided_regex": "a+"})
    assert r.status == 400 and r.json()["error"]["param"] == "tool_choice"


async def test_gpt_oss_channels_are_split_without_tools():
    words = ("<|channel|>analysis<|message|>", "Easy.", "<|end|><|start|>assistant<|channel|>final<|message|>", "4.")
    engine = FakeEngine(words=words)
    engine.reasoning_format = "harmony"
    app = ServerApp(engine, manage_engine=False)
    r = await call(app, "POST", CHAT, {"messages": MESSAGES, "max_tokens": len(words)})
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Easy.", "4.")
    (_, params), = engine.submitted
    assert params.skip_special_tokens is False  # the channel markers are special tokens
