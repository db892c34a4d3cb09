"""/tokenize and /detokenize against a real `metrale serve` (the tiny Hermes-template model of
test_tools_openai.py): the count is the prompt_tokens a request uses, for a prompt and for messages with tools."""

from __future__ import annotations

import openai
import pytest

from tests.server.serve import ServerProcess
from tests.server.test_tools_openai import MESSAGES, TOOLS, model_path  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(model_path):  # noqa: F811
    with ServerProcess("--model", str(model_path), "--max-model-len", "2048", "--kv-cache-mib", "32") as server:
        yield server


def test_counts_equal_what_requests_use(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120) as client:
        completion = client.completions.create(model="tiny-tools", prompt="hello there", max_tokens=1)
        chat = client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=TOOLS,
                                              tool_choice="required", max_tokens=1)
    status, body = server.post_json("/tokenize", {"prompt": "hello there"})
    assert status == 200 and body["count"] == completion.usage.prompt_tokens
    status, body = server.post_json("/tokenize", {"messages": MESSAGES, "tools": TOOLS, "return_token_strs": True})
    assert status == 200 and body["count"] == chat.usage.prompt_tokens == len(body["token_strs"])
    status, back = server.post_json("/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and "What is the weather in Oslo?" in back["prompt"]


def test_an_id_outside_the_vocabulary_is_a_400(server):
    status, body = server.post_json("/detokenize", {"tokens": [1, 10**6]})
    assert status == 400 and "token" in body["error"]["message"]
