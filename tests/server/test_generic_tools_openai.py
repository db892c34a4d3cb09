"""Tools out of the box and reasoning through the official openai client against a real `metrale serve`
of a tiny random model whose chat template (ChatML) knows no tool format.

`tools` without `tool_choice` is "auto": the server gives the model the generic format (llama.cpp's):
the tools and the answer's shape in the system message, a grammar that holds the output to a call or a
response. The random model's answer is noise, but always one of the two, valid against the schema.
Reasoning: with --reasoning-parser think, a <think> block (forced with guided_choice) is
reasoning_content, streamed as its own deltas."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from mlx.utils import tree_flatten

from metrale.text.chat_template import CHATML
from tests.metrale.model_helpers import byte_vocab, make_twins, tiny_config_dict, write_tiny_gguf
from tests.server.serve import ServerProcess

pytest.importorskip("llguidance")
pytestmark = pytest.mark.timeout(300)

VOCAB = 320
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
              "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMETERS}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    config = tiny_config_dict(vocab_size=VOCAB, max_position_embeddings=2048)
    _, model = make_twins(config)
    path = tmp_path_factory.mktemp("tiny-chatml") / "tiny-chatml.gguf"
    write_tiny_gguf(str(path), config, tree_flatten(model.parameters()), vocab=byte_vocab(VOCAB),
                    chat_template=CHATML)
    with ServerProcess("--model", str(path), "--max-model-len", "2048", "--kv-cache-mib", "32",
                       "--reasoning-parser", "think") as server:
        with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120) as client:
            yield client


def check_answer(message, finish_reason) -> None:
    """A call valid against its schema, or text (the random model's noise may run into max_tokens)."""
    if message.tool_calls:
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        if finish_reason != "length":
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)
            assert finish_reason == "tool_calls"
    else:
        assert isinstance(message.content, str) and finish_reason in ("stop", "length")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tools_without_tool_choice_answer_with_a_call_or_text(client, seed):
    out = client.chat.completions.create(model="tiny-chatml", messages=MESSAGES, tools=TOOLS, max_tokens=400,
                                         temperature=1.0, seed=seed, parallel_tool_calls=False)
    (choice,) = out.choices
    check_answer(choice.message, choice.finish_reason)
    chunks = list(client.chat.completions.create(model="tiny-chatml", messages=MESSAGES, tools=TOOLS, max_tokens=400,
                                                 temperature=1.0, seed=seed, parallel_tool_calls=False,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    if choice.message.tool_calls:  # seeded: the same answer
        assert "".join(tc.function.arguments or "" for tc in calls) == choice.message.tool_calls[0].function.arguments
    else:
        assert content == choice.message.content and not calls


def test_reasoning_content_streamed_and_not(client):
    extra = {"extra_body": {"guided_choice": ["<think>Oslo is cold.</think>Cold."]}}
    out = client.chat.completions.create(model="tiny-chatml", messages=MESSAGES, max_tokens=100, **extra)
    message = out.choices[0].message
    assert (message.reasoning_content, message.content) == ("Oslo is cold.", "Cold.")
    chunks = list(client.chat.completions.create(model="tiny-chatml", messages=MESSAGES, max_tokens=100,
                                                 stream=True, **extra))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Oslo is cold."
    assert "".join(d.content or "" for d in deltas) == "Cold."


# real templates (llama.cpp's copies): the server picks the formats from the GGUF's template
FORCED = {
    "Qwen-Qwen3-0.6B.jinja": '<think>\nOslo, so weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                             '"arguments": {"city": "Oslo"}}\n</tool_call>',
    "openai-gpt-oss-120b.jinja": '<|channel|>analysis<|message|>Oslo, so weather.<|end|><|start|>assistant'
                                 '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                                 '{"city": "Oslo"}',
    "Qwen3.5-4B.jinja": 'Oslo, so weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n'
                        '</parameter>\n</function>\n</tool_call>',
}


@pytest.mark.parametrize("name", sorted(FORCED))
def test_a_real_templates_formats_are_read_through_the_client(tmp_path, name):
    from tests.llamacpp_assets import template_path
    config = tiny_config_dict(vocab_size=VOCAB, max_position_embeddings=4096)
    _, model = make_twins(config)
    path = tmp_path / "tiny-real-template.gguf"
    write_tiny_gguf(str(path), config, tree_flatten(model.parameters()), vocab=byte_vocab(VOCAB),
                    chat_template=template_path(name).read_text(encoding="utf-8"))
    extra = {"extra_body": {"guided_choice": [FORCED[name]]}}
    with ServerProcess("--model", str(path), "--max-model-len", "4096", "--kv-cache-mib", "64") as server:
        with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120) as client:
            out = client.chat.completions.create(model="tiny-real-template", messages=MESSAGES, tools=TOOLS, max_tokens=400, **extra)
            (choice,) = out.choices
            assert choice.message.reasoning_content.strip() == "Oslo, so weather.", choice
            (call,) = choice.message.tool_calls
            assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
            assert choice.finish_reason == "tool_calls"
            chunks = list(client.chat.completions.create(model="tiny-real-template", messages=MESSAGES, tools=TOOLS, max_tokens=400,
                                                         stream=True, **extra))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas).strip() == "Oslo, so weather."
            calls = [tc for d in deltas for tc in d.tool_calls or []]
            assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Oslo"}
