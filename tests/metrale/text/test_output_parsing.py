"""Tool calls and reasoning round-trip through llama.cpp's real chat templates (models/templates/).

A call is rendered into the history by the model's own template; the model-side text of that turn is
parsed back (with the format and reasoning parser the template selects) into the same calls, whole and
streamed split at every character (and one character at a time). TEMPLATES is the template table.
"""

from __future__ import annotations

import json
import os

import pytest

from metrale.text.chat_template import ChatTemplate
from metrale.text.output_parsing import ChatOutputParser, detect_format, make_parser
from metrale.text.reasoning import ReasoningParser, detect_reasoning
from metrale.text.tool_calls import ParsedOutput, collect
from tests.llamacpp_assets import template_path

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "hourly": {"type": "boolean"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]
CALLS = [("get_weather", {"city": 'Zürich "Nord"', "days": 3, "hourly": True}), ("get_time", {"zone": "Europe/Oslo"})]
TURN_ENDS = ("<sep>", "<｜Assistant｜>", "<|im_end|>", "<|eot_id|>", "</s>", "<｜end▁of▁sentence｜>", "<|end_of_text|>", "<|call|>", "<|end|>",
             "<|eom_id|>")

# template -> (tool-call format, reasoning format, calls one turn can render)
TEMPLATES = {
    "Qwen-Qwen3-0.6B.jinja": ("hermes", "think", 2),
    "Qwen-QwQ-32B.jinja": ("hermes", "think", 2),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("hermes", None, 2),
    "Qwen3-Coder.jinja": ("qwen3_coder", None, 2),
    "Qwen3.5-4B.jinja": ("qwen3_coder", "think", 2),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": ("qwen3_coder", "think", 2),
    "StepFun3.5-Flash.jinja": ("qwen3_coder", "think", 2),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": ("hermes", None, 2),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": ("hermes", None, 2),
    "MiMo-VL.jinja": ("hermes", None, 2),
    "Reka-Edge.jinja": ("hermes", "think", 2),
    "Bielik-11B-v3.0-Instruct.jinja": ("hermes", "think", 2),
    "ibm-granite-granite-4.0.jinja": ("hermes", None, 2),
    "ibm-granite-granite-4.1.jinja": ("hermes", None, 2),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("llama3_json", None, 1),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("llama3_json", None, 1),
    "meta-llama-Llama-3.3-70B-Instruct.jinja": ("llama3_json", None, 1),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("mistral", None, 2),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("mistral", None, 2),
    "unsloth-mistral-Devstral-Small-2507.jinja": ("mistral", None, 2),
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": ("mistral", "mistral", 2),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("deepseek", "think", 2),
    "deepseek-ai-DeepSeek-V3.1.jinja": ("deepseek", "think", 2),
    "LFM2.5-8B-A1B.jinja": ("pythonic", "think", 2),
    "openai-gpt-oss-120b.jinja": ("harmony", "harmony", 1),
}
# templates with no tool format metrale reads: the server gives their models the generic format
GENERIC = ["google-gemma-2-2b-it.jinja", "microsoft-Phi-3.5-mini-instruct.jinja", "GLM-4.6.jinja",
           "MiniMax-M1.jinja", "meetkai-functionary-medium-v3.1.jinja", "deepseek-ai-DeepSeek-V3.2.jinja"]


def model_side_text(template: ChatTemplate, calls: list[tuple[str, dict]], **kwargs) -> tuple[str, str]:
    """(the history before the assistant turn, the turn's text) of a turn that makes `calls`."""
    before = [{"role": "user", "content": "Weather in Zürich?"}]
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"ab12CD3{i}e", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate(calls)]}  # Mistral's templates want 9-character ids
    prompt = template.render(before, add_generation_prompt=True, tools=TOOLS, **kwargs)
    history = template.render([*before, turn], add_generation_prompt=False, tools=TOOLS, **kwargs)
    common = os.path.commonprefix([prompt, history])
    if common != prompt:  # the generation prompt differs (QwQ opens <think>): cut at a tag or line end
        common = common[:max(common.rfind(c) for c in (">", "\n", "]")) + 1]
    text = history[len(common):].rstrip()
    while text.endswith(TURN_ENDS):
        text = next(text[:-len(end)] for end in TURN_ENDS if text.endswith(end)).rstrip()
    return common, text


def output_parser(source: str, prompt: str) -> ChatOutputParser:
    reasoning = detect_reasoning(source)
    read = reasoning is not None and reasoning != "harmony"  # gpt-oss's channels: read by its tool parser
    return ChatOutputParser(make_parser(detect_format(source) or "generic", TOOLS),
                            ReasoningParser.for_prompt(reasoning, prompt[-300:]) if read else None)


def parse_everywhere(source: str, prompt: str, text: str) -> ParsedOutput:
    """The parse of `text` whole, asserted equal to every two-piece split and to one character at a time."""
    parser = output_parser(source, prompt)
    whole = collect([parser.feed(text), parser.finish()])
    for cut in range(len(text) + 1):
        parser = output_parser(source, prompt)
        assert collect([parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()]) == whole, cut
    parser = output_parser(source, prompt)
    assert collect([parser.feed(char) for char in text] + [parser.finish()]) == whole
    return whole


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tool_calls_round_trip_through_the_real_template(name):
    source = template_path(name).read_text(encoding="utf-8")
    fmt, reasoning, max_calls = TEMPLATES[name]
    assert (detect_format(source), detect_reasoning(source)) == (fmt, reasoning)
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    for count in range(1, max_calls + 1):
        prompt, text = model_side_text(template, CALLS[:count])
        parsed = parse_everywhere(source, prompt, text)
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == CALLS[:count], text
        assert parsed.content.strip() == "" and parsed.reasoning.strip() == ""


@pytest.mark.parametrize("name", ["meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.3-70B-Instruct.jinja"])
def test_llama_builtin_tools_round_trip_through_python_tag(name):
    source = template_path(name).read_text(encoding="utf-8")
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    call = ("brave_search", {"query": "weather Zürich"})
    prompt, text = model_side_text(template, [call], builtin_tools=["brave_search", "wolfram_alpha"])
    assert text.startswith("<|python_tag|>brave_search.call(")
    parsed = parse_everywhere(source, prompt, text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [call] and parsed.content == ""


@pytest.mark.parametrize("name", GENERIC)
def test_templates_without_a_format_metrale_reads_get_the_generic_one(name):
    assert detect_format(template_path(name).read_text(encoding="utf-8")) is None


GENERIC_CASES = [
    ('{"tool_call": {"name": "get_weather", "arguments": {"city": "Zürich \\"Nord\\"", "days": 3, "hourly": true}}}',
     "", CALLS[:1]),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich \\"Nord\\"", "days": 3, "hourly": true}},'
     ' {"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}]}', "", CALLS),
    ('{"response": "Sunny, 21 \\u00b0C \\ud83c\\udf1e \\"quoted\\"\\n"}', 'Sunny, 21 °C 🌞 "quoted"\n', []),
    ('{"response": {"a": [1, "x\\"}"]}}', '{"a": [1, "x\\"}"]}', []),  # with a response_format schema
    ("not JSON at all", "not JSON at all", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), GENERIC_CASES)
def test_generic_answers_stream_as_content_or_calls(text, content, calls):
    parsed = parse_everywhere("", "", text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls


REASONING_CASES = [  # (format, prompt tail, output, reasoning, content)
    ("think", "<|im_start|>assistant\n", "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "It is 4."),
    ("think", "<｜Assistant｜><think>\n", "Let me see.</think>It is 4.", "Let me see.", "It is 4."),
    ("think", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "It is 4.", "", "It is 4."),
    ("think", "<|im_start|>assistant\n", "It is 4, <think> is a tag.", "", "It is 4, <think> is a tag."),
    ("think", "<｜Assistant｜><think>\n", "Still thinking when max_tokens hit", "Still thinking when max_tokens hit", ""),
    ("mistral", "[/INST]", "[THINK]Hmm.[/THINK]Answer.", "Hmm.", "Answer."),
]


@pytest.mark.parametrize(("fmt", "tail", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_is_split_from_the_answer(fmt, tail, text, reasoning, content):
    source = {"think": "<think>", "mistral": "[THINK]"}[fmt]
    parsed = parse_everywhere(source, tail, text)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)


def test_harmony_splits_analysis_final_and_calls():
    source = template_path("openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
    text = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_time <|constrain|>json<|message|>{"zone": "Europe/Oslo"}')
    parsed = parse_everywhere(source, "<|start|>assistant", text)
    assert parsed.reasoning == "Need weather."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [CALLS[1]]
    final = parse_everywhere(source, "<|start|>assistant", "<|channel|>analysis<|message|>Easy.<|end|>"
                                                            "<|start|>assistant<|channel|>final<|message|>4.")
    assert (final.reasoning, final.content, final.tool_calls) == ("Easy.", "4.", ())
