"""Tool-call parsers on model texts in each family's format: the complete text, the same text streamed split
at every character boundary (and one character at a time) gives the same content and calls, and the
deltas have OpenAI's shape (name first, then argument fragments that add up to the arguments' JSON)."""

from __future__ import annotations

import json

import pytest

from metrale.text.tool_calls import ParsedOutput, ToolCall, collect
from metrale.text.output_parsing import detect_format, make_parser, parse_tool_calls
from metrale.text.tool_parsers import NamedCallParser

WEATHER = '{"location": "San Francisco, CA, USA", "unit": "celsius"}'
UNICODE = '{"city": "Zürich", "note": "naïve \\"quoted\\" ✓ 東京", "days": [1, 2.5, -3e2], "ok": true, "x": null}'

# (format, text as the model writes it, expected content, expected calls)
CASES = [
    # Qwen2.5 / Qwen3 / Hermes 2 Pro: one call, several calls, text before, arguments in another order
    ("hermes", f'<tool_call>\n{{"name": "get_current_temperature", "arguments": {WEATHER}}}\n</tool_call>',
     "", [("get_current_temperature", WEATHER)]),
    ("hermes", f'Let me check both.\n<tool_call>\n{{"name": "get_weather", "arguments": {UNICODE}}}\n</tool_call>\n'
               f'<tool_call>\n{{"arguments": {{}}, "name": "get_time"}}\n</tool_call>',
     "Let me check both.\n", [("get_weather", UNICODE), ("get_time", "{}")]),
    ("hermes", "The weather in Paris is sunny, 21 °C. <tool_call is a tag I know.", "The weather in Paris is sunny, "
     "21 °C. <tool_call is a tag I know.", []),
    ("hermes", '<tool_call>\nnot a json object\n</tool_call>', '<tool_call>\nnot a json object\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "", [("f", '{"a": 1}')]),
    # Llama 3.1 / 3.2 / 3.3 JSON tool calling, with and without <|python_tag|>, two calls
    ("llama3_json", '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
                    '"unit": "Fahrenheit"}}', "",
     [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')]),
    ("llama3_json", f'<|python_tag|>{{"name": "a", "parameters": {UNICODE}}}; {{"name": "b", "parameters": {{}}}}', "",
     [("a", UNICODE), ("b", "{}")]),
    ("llama3_json", "I can answer that without tools: 42.", "I can answer that without tools: 42.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="Zürich \\"Nord\\" weather")', "",
     [("brave_search", '{"query": "Zürich \\"Nord\\" weather"}')]),
    ("llama3_json", "<|python_tag|>print(1 +", "<|python_tag|>print(1 +", []),
    # Mistral 7B Instruct v0.3 / Nemo (decoded with special tokens)
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_current_weather", "arguments": {WEATHER}}}]', "",
     [("get_current_weather", WEATHER)]),
    ("mistral", f'Sure. [TOOL_CALLS][{{"name": "a", "arguments": {UNICODE}}}, {{"name": "b", "arguments": {{}}}}]',
     "Sure. ", [("a", UNICODE), ("b", "{}")]),
    # Mistral Small 3.2 / Devstral / Magistral (v11+ tokenizers), with and without call ids; a marker that is text
    ("mistral", f'Checking.[TOOL_CALLS]get_weather[ARGS]{UNICODE}[TOOL_CALLS]t[CALL_ID]ab12CD34e[ARGS]{{}}',
     "Checking.", [("get_weather", UNICODE), ("t", "{}")]),
    ("mistral", "The [TOOL_CALLS] marker, said aloud.", "The [TOOL_CALLS] marker, said aloud.", []),
    # Granite 3.x
    ("granite", f'<|tool_call|>[{{"name": "a", "arguments": {UNICODE}}}]', "", [("a", UNICODE)]),
    # DeepSeek R1 / V3 and V3.1
    ("deepseek", f'Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{UNICODE}\n```'
                 '<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>b\n```json\n{}\n```<｜tool▁call▁end｜>'
                 '<｜tool▁calls▁end｜>', "Let me look.", [("a", UNICODE), ("b", "{}")]),
    ("deepseek", f'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{UNICODE}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "", [("a", UNICODE)]),
    # Qwen3-Coder XML (values typed by the schema; without tools: JSON when it reads as JSON)
    ("qwen3_coder", 'Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich "Nord"\n</parameter>\n'
                    '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=t>\n'
                    '</function>\n</tool_call>',
     "Sure.\n", [("get_weather", '{"city": "Zürich \\"Nord\\"", "days": 3}'), ("t", "{}")]),
    # pythonic (Llama 4, LFM2)
    ("pythonic", '[get_weather(city="Zürich", days=[1, 2.5]), get_time()]', "",
     [("get_weather", '{"city": "Zürich", "days": [1, 2.5]}'), ("get_time", "{}")]),
    ("pythonic", 'Here.<|tool_call_start|>[a(x=True, y=None)]<|tool_call_end|>Done.', "Here.Done.",
     [("a", '{"x": true, "y": null}')]),
    ("pythonic", "[1, 2] is a list, not a call.", "[1, 2] is a list, not a call.", []),
    # tool_choice "required" (vLLM's list of {"name", "parameters"})
    ("json_list", f'[\n  {{"name": "get_weather", "parameters": {UNICODE}}},\n  {{"name": "t", "parameters": {{}}}}\n]',
     "", [("get_weather", UNICODE), ("t", "{}")]),
]


def expected(content: str, calls: list[tuple[str, str]]) -> ParsedOutput:
    return ParsedOutput(content, tuple(ToolCall(name, args) for name, args in calls))


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_complete_and_streamed_at_every_split_agree(fmt, text, content, calls):
    whole = parse_tool_calls(fmt, text)
    assert whole == expected(content, calls)
    for name, args in calls:
        json.loads(args)
    for cut in range(len(text) + 1):
        parser = make_parser(fmt)
        assert collect([parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()]) == whole, cut
    parser = make_parser(fmt)
    assert collect([parser.feed(char) for char in text] + [parser.finish()]) == whole


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), [c for c in CASES if c[3]])
def test_deltas_have_openai_shape(fmt, text, content, calls):
    parser = make_parser(fmt)
    deltas = [d for char in text for d in parser.feed(char).tool_calls] + parser.finish().tool_calls
    seen: list[int] = []
    for delta in deltas:
        if delta.name is not None:
            assert delta.index == len(seen)  # a call's first delta names it, in order
            seen.append(delta.index)
        else:
            assert seen and delta.index == seen[-1] and delta.arguments  # then fragments of that call
    assert len(seen) == len(calls)


def test_text_before_a_call_streams_before_the_call_is_complete():
    parser = make_parser("hermes")
    assert parser.feed("Checking the weather").content == "Checking the weather"
    assert parser.feed(" now <tool_").content == " now "  # a partial marker is held back
    out = parser.feed('call>{"name": "get_weather", "arguments": {"city": "Pa')
    assert out.content == "" and out.tool_calls[0].name == "get_weather"
    assert out.tool_calls[-1].arguments == '{"city": "Pa'  # arguments stream as they are generated


def test_truncated_output_keeps_what_was_said():
    assert parse_tool_calls("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2') == \
        expected("", [("f", '{"a": [1, 2')])
    assert parse_tool_calls("hermes", 'ok <tool_call>\n{"nam') == expected('ok <tool_call>\n{"nam', [])
    assert parse_tool_calls("mistral", "[TOOL_CAL") == expected("[TOOL_CAL", [])


def test_named_call_streams_its_arguments():
    parser = NamedCallParser("get_weather")
    first = parser.feed('{"city"')
    assert first.tool_calls[0].name == "get_weather" and first.tool_calls[0].arguments == '{"city"'
    rest = [parser.feed(': "Oslo"}'), parser.finish()]
    assert collect([first, *rest]) == expected("", [("get_weather", '{"city": "Oslo"}')])


@pytest.mark.parametrize(("template", "fmt"), [
    ("{%- for tool_call in message.tool_calls %}{{- '\\n<tool_call>\\n{\"name\": \"' }}", "hermes"),
    ("{%- if message.tool_calls %}{{- '[TOOL_CALLS] [' }}", "mistral"),
    ("{%- if builtin_tools is defined %}{{- '<|python_tag|>' }}{%- endif %} role == 'ipython'", "llama3_json"),
    ("{% for message in messages %}<|im_start|>{{ message['role'] }}", None),
    (None, None),
])
def test_format_detected_from_the_chat_template(template, fmt):
    assert detect_format(template) == fmt


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown tool call format 'xml'"):
        make_parser("xml")


DEEP = "[" * 100_000 + "]" * 100_000  # model-written nesting far past Python's recursion limit


@pytest.mark.parametrize(("fmt", "text"), [
    ("hermes", f'<tool_call>{{"name": {DEEP}, "arguments": {{}}}}</tool_call>'),
    ("llama3_json", f'{{"name": {DEEP}, "parameters": {{}}}}'),
    ("mistral", f'[TOOL_CALLS][{{"name": {DEEP}, "arguments": {{}}}}]'),
    ("hermes", f'<tool_call>{{"name": "f", "arguments": {DEEP}}}</tool_call>'),
])
def test_deep_nesting_in_a_call_ends_cleanly(fmt, text):
    parsed = parse_tool_calls(fmt, text)  # raised RecursionError for a nested name
    assert all(call.name == "f" for call in parsed.tool_calls)
    assert parsed.tool_calls or parsed.content == text  # not a call: it stays text
