"""Chat templates: the default model's own template and the built-ins render known-good strings;
bad messages are refused with a clear error; the environment behaves like Hugging Face's."""

from __future__ import annotations

import json

import jinja2
import pytest

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from metrale.text.chat_template import BUILTIN_TEMPLATES, ChatTemplate, ChatTemplateError, validate_messages
from metrale.text.tokenizer import Tokenizer

from tests.llamacpp_assets import template_path
from tests.metrale.text_helpers import gguf_metadata

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " What is 2+2? "},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks"},
]


def test_default_model_template_from_gguf():
    template = ChatTemplate.for_tokenizer(Tokenizer.from_gguf_metadata(gguf_metadata()), "llama")
    assert template.special_tokens["bos_token"] == "<|im_start|>"
    assert template.special_tokens["eos_token"] == "<|im_end|>"
    assert template.render([{"role": "user", "content": "What is the capital of France?"}]) == (
        SMOL_SYSTEM + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert template.render(CONVERSATION, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n What is 2+2? <|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n")


def test_chatml_builtin():
    template = ChatTemplate.builtin("chatml")
    assert template.render(CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n What is 2+2? <|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    assert template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n")


def test_qwen3_builtin():
    template = ChatTemplate.builtin("qwen3")
    assert template.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert template.render([{"role": "user", "content": "Hi"}], enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    history = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"},
               {"role": "user", "content": "Q2"}]
    assert template.render(history) == (  # reasoning of turns before the last question is dropped
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n")
    assert template.render(history[:2], add_generation_prompt=False) == (  # ...and kept after it
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nA1<|im_end|>\n")
    tools = [{"role": "system", "content": "S"}, {"role": "user", "content": "weather?"},
             {"role": "assistant", "content": "calling"}, {"role": "tool", "content": "sunny"},
             {"role": "tool", "content": "warm"}]
    assert template.render(tools) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nweather?<|im_end|>\n"
        "<|im_start|>assistant\ncalling<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nwarm\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_gemma3_builtin():
    template = ChatTemplate.builtin("gemma3")
    assert template.render(CONVERSATION) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nThanks<end_of_turn>\n<start_of_turn>model\n")
    assert template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n")
    with pytest.raises(ValueError, match="alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize(("messages", "match"), [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ({"role": "user", "content": "hi"}, "non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "hi"}], r"messages\[0\]\.role must be one of"),
    ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], r"messages\[1\]\.role .* got 'bot'"),
    ([{"role": "user", "content": 42}], r"messages\[0\]\.content must be a string"),
    ([{"role": "user"}], r"messages\[0\]\.content must be a string .* got NoneType"),
    ([{"role": "assistant", "content": None}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], r"content\[0\].*only text"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\]"),
])
def test_bad_messages_are_refused(messages, match):
    for name in BUILTIN_TEMPLATES:
        with pytest.raises(ValueError, match=match):
            ChatTemplate.builtin(name).render(messages)


def test_text_parts_are_joined_and_tool_call_turns_accepted():
    checked = validate_messages([
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
    ])
    assert checked[0]["content"] == "Hello\nworld" and checked[1]["content"] == ""
    assert "tool_calls" in checked[1]


def test_hugging_face_environment_helpers():
    source = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
              "|{{ strftime_now('%Y') | length }}|{% generation %}{{ eos_token }}{% endgeneration %}")
    rendered = ChatTemplate(source, eos_token="</s>").render(
        [{"role": "user", "content": "café"}, {"role": "user", "content": "second"}])
    assert rendered == json.dumps({"role": "user", "content": "café"}, ensure_ascii=False) + "|4|</s>"
    with pytest.raises(ChatTemplateError, match="nope"):
        ChatTemplate("{{ raise_exception('nope') }}").render([{"role": "user", "content": "x"}])


def test_template_is_sandboxed_and_compiled_once():
    evil = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.render([{"role": "user", "content": "x"}])
    mutate = ChatTemplate("{% set x = [] %}{{ x.append(1) }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        mutate.render([{"role": "user", "content": "x"}])
    assert ChatTemplate(BUILTIN_TEMPLATES["chatml"])._template is ChatTemplate.builtin("chatml")._template


def _write_word_tokenizer(folder, words):
    """A minimal tokenizer.json (word level) so that Tokenizer.from_folder can read the folder."""
    backend = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.add_special_tokens(words[:2])
    backend.save(str(folder / "tokenizer.json"))


def _from_folder(folder, architecture="llama"):
    return ChatTemplate.for_tokenizer(Tokenizer.from_folder(folder), architecture)


def test_from_pretrained_folder_and_fallbacks(tmp_path):
    _write_word_tokenizer(tmp_path, ["<s>", "</s>", "hi"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
                          {"name": "tool_use", "template": "tools"}],
        "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}))
    assert _from_folder(tmp_path).render([{"role": "user", "content": "hi"}]) == "<s>hi"
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert _from_folder(tmp_path).render([{"role": "user", "content": "hi"}]) == "J</s>"
    bare = tmp_path / "bare"
    bare.mkdir()
    _write_word_tokenizer(bare, ["<unk>", "<pad>", "hi"])
    assert _from_folder(bare, "gemma3_text").name == "gemma3"
    assert _from_folder(bare, "qwen3").name == "qwen3"
    assert _from_folder(bare, "llama").name == "chatml"
    with pytest.raises(ValueError, match="unknown built-in"):
        ChatTemplate.builtin("vicuna")


def test_tools_tool_calls_and_tool_results_reach_the_template():
    from tests.metrale.templates import HERMES_TOOLS_TEMPLATE

    template = ChatTemplate(HERMES_TOOLS_TEMPLATE, eos_token="<|im_end|>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 °C"},
    ]
    prompt = template.render(messages, tools=tools)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt  # the tool definitions
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<tool_response>\n12 °C\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in template.render(messages[:1])  # no tools: no tool prompt


def test_llama3_builtin_for_a_llama_model_without_a_template(tmp_path):
    words = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "hi"]
    backend = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.add_special_tokens(words[:4])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                                "eos_token": "<|eot_id|>"}))
    template = _from_folder(tmp_path, "llama")
    assert template.name == "llama3"
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "tool", "content": "42"}]
    assert template.render(messages) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert _from_folder(tmp_path, "qwen3").name == "qwen3"  # the architecture decides first


def test_template_kwargs_are_template_variables():
    template = ChatTemplate("{{ messages[0]['content'] }}{% if enable_thinking is false %} /no_think{% endif %}")
    messages = [{"role": "user", "content": "Hi"}]
    assert template.render(messages) == "Hi"
    assert template.render(messages, enable_thinking=False) == "Hi /no_think"


def test_developer_is_the_templates_developer_turn_or_system():
    messages = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "hi"}]
    chatml = ChatTemplate.builtin("chatml")
    assert chatml.render(messages) == chatml.render([{**messages[0], "role": "system"}, messages[1]])
    assert "<|im_start|>system\nAnswer in French." in chatml.render(messages)
    gpt_oss = ChatTemplate(template_path("openai-gpt-oss-120b.jinja").read_text(encoding="utf-8"))
    assert gpt_oss.has_developer_role and not chatml.has_developer_role
    assert "<|start|>developer<|message|># Instructions\n\nAnswer in French." in gpt_oss.render(messages)


def test_a_field_the_template_reads_but_the_request_lacks_is_a_template_error():
    gpt_oss = ChatTemplate(template_path("openai-gpt-oss-120b.jinja").read_text(encoding="utf-8"))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(ChatTemplateError, match="description"):
        gpt_oss.render([{"role": "user", "content": "hi"}], tools=tools)
