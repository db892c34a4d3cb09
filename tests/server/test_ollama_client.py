"""The official `ollama` client against a real `metrale serve`: the default model answering a question streamed and
not, and a tool-call history rendered exactly as the OpenAI route renders the same conversation (the tiny
Hermes-template model of test_tools_openai.py)."""

from __future__ import annotations

import json
from contextlib import closing

import ollama
import openai
import pytest

from tests.server.serve import SMALL, ServerProcess
from tests.server.test_tools_openai import MESSAGES, TOOLS, model_path  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.mark.real_model
def test_the_default_model_answers_through_the_ollama_client():
    with ServerProcess(*SMALL) as server:
        with closing(ollama.Client(host=server.url(""), timeout=120)) as client:
            (listed,) = client.list().models
            full = client.chat(model=listed.model, messages=QUESTION, options={"temperature": 0, "num_predict": 16})
            parts = list(client.chat(model=listed.model, messages=QUESTION, stream=True,
                                     options={"temperature": 0, "num_predict": 16}))
            generated = client.generate(model=f"{listed.model}:latest", prompt=QUESTION[0]["content"],
                                        options={"temperature": 0, "num_predict": 16})
    assert "Paris" in full.message.content and full.done and full.eval_count <= 16
    assert "".join(p.message.content for p in parts) == full.message.content
    assert parts[-1].done and parts[-1].done_reason == full.done_reason
    assert generated.response == full.message.content  # the same chat template, the same greedy answer


@pytest.fixture(scope="module")
def server(model_path):  # noqa: F811
    with ServerProcess("--model", str(model_path), "--max-model-len", "2048", "--kv-cache-mib", "32") as server:
        yield server


def test_a_tool_history_renders_as_the_openai_route_renders_it(server):
    call = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}
    history = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
               {"role": "tool", "content": '{"temperature": 12}', "tool_name": "get_weather"}]
    with closing(ollama.Client(host=server.url(""), timeout=120)) as client:
        answer = client.chat(model="tiny-tools", messages=history, tools=TOOLS, options={"num_predict": 1})
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120) as oa:
        # the tools as the ollama client sends them (its Tool model keeps only some JSON-schema keywords)
        sent_tools = [ollama.Tool.model_validate(tool).model_dump(exclude_none=True) for tool in TOOLS]
        same = oa.chat.completions.create(model="tiny-tools", max_tokens=1, tools=sent_tools, messages=[
            *MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1_0", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
            {"role": "tool", "content": '{"temperature": 12}', "name": "get_weather"}])
    assert answer.prompt_eval_count == same.usage.prompt_tokens
    assert answer.done and answer.eval_count == 1


def test_format_makes_json(server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"],
              "additionalProperties": False}
    with closing(ollama.Client(host=server.url(""), timeout=120)) as client:
        answer = client.generate(model="tiny-tools", prompt="a city", format=schema, options={"num_predict": 60})
    assert set(json.loads(answer.response)) == {"city"}
