"""Tool calling through the official openai client against a real `metrale serve` of a tiny random model
whose chat template is Qwen-style (Hermes <tool_call> format, tools in the system prompt).

The model's weights are random, so what it says is noise; the grammar makes tool_choice "required" and
a named function valid calls anyway, and "auto" is shown a Hermes call by forcing its text with
guided_choice. The round trip sends the call and the tool's result back in the history and checks the
prompt the server rendered (its token count equals the template rendered here)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from mlx.utils import tree_flatten

from metrale.text.chat_template import ChatTemplate
from metrale.text.tokenizer import Tokenizer
from tests.metrale.model_helpers import byte_vocab, make_twins, tiny_config_dict, write_tiny_gguf
from tests.metrale.templates import HERMES_TOOLS_TEMPLATE
from tests.server.serve import ServerProcess

pytest.importorskip("llguidance")
pytestmark = pytest.mark.timeout(300)

VOCAB = 320
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                               "unit": {"enum": ["c", "f"]}},
              "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
FORCED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    config = tiny_config_dict(vocab_size=VOCAB, max_position_embeddings=2048)
    _, model = make_twins(config)
    path = tmp_path_factory.mktemp("tiny-tools") / "tiny-tools.gguf"
    write_tiny_gguf(str(path), config, tree_flatten(model.parameters()), vocab=byte_vocab(VOCAB),
                    chat_template=HERMES_TOOLS_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(model_path):
    with ServerProcess("--model", str(model_path), "--max-model-len", "2048", "--kv-cache-mib", "32") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120) as client:
        yield client  # closed with the module: no connection is left for the garbage collector


def create(client, **kwargs):
    return client.chat.completions.create(model="tiny-tools", messages=kwargs.pop("messages", MESSAGES),
                                          max_tokens=kwargs.pop("max_tokens", 300), **kwargs)


def check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(arguments, schema)
    return arguments


def test_required_gives_valid_calls(client):
    out = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=1)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    check_call(call)


def test_named_function_streams_its_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = create(client, tools=TOOLS, tool_choice=named, temperature=0)
    (call,) = full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "stop" and call.function.name == "get_weather"
    check_call(call)
    chunks = list(create(client, tools=TOOLS, tool_choice=named, temperature=0, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].index == 0
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # greedy: the same call
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_auto_parses_a_hermes_call_streamed_and_not(client):
    extra = {"extra_body": {"guided_choice": [FORCED]}}
    full = create(client, tools=TOOLS, tool_choice="auto", **extra)
    (choice,) = full.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and check_call(call) == {"city": "Oslo", "unit": "c"}
    chunks = list(create(client, tools=TOOLS, stream=True, **extra))
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Oslo", "unit": "c"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_round_trip_renders_the_call_and_the_result_through_the_template(client, model_path):
    first = create(client, tools=TOOLS, tool_choice="required", temperature=0, parallel_tool_calls=False)
    assert first.choices[0].finish_reason == "tool_calls"
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    history = [*MESSAGES, assistant,
               *({"role": "tool", "tool_call_id": c["id"], "content": '{"temperature": 12}'}
                 for c in assistant["tool_calls"])]
    second = create(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert second.choices[0].message.content is not None and second.usage.completion_tokens <= 4
    # the server rendered exactly what Hugging Face's apply_chat_template would (arguments as objects)
    import kernels.runtime  # noqa: F401
    import mlx.core as mx

    _, metadata = mx.load(str(model_path), return_metadata=True)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    decoded = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                       "arguments": json.loads(c["function"]["arguments"])}}
                                    for c in m["tool_calls"]]} if "tool_calls" in m else m for m in history]
    prompt = ChatTemplate(HERMES_TOOLS_TEMPLATE).render(decoded)  # tool_choice none: no tools in the prompt
    assert '<tool_call>\n{"name": "' in prompt and "<tool_response>" in prompt
    assert second.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    with_tools = create(client, messages=history, tools=TOOLS, tool_choice="required", max_tokens=300)
    assert with_tools.usage.prompt_tokens == len(tokenizer.encode(
        ChatTemplate(HERMES_TOOLS_TEMPLATE).render(decoded, tools=TOOLS), add_special_tokens=False))
    assert with_tools.choices[0].message.tool_calls


def test_bad_tool_requests_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="Invalid type"):
        create(client, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
               tool_choice="required")
