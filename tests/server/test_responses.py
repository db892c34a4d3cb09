"""POST /v1/responses through the official openai client (client.responses.create), in process over
ASGI, on a tiny real engine: text in (a string, or messages with instructions), text out, streamed
events, function_call output items, refused fields, and every block freed after each scenario."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import pytest_asyncio

from mlx.utils import tree_flatten

from metrale import AsyncEngine, EngineConfig
from metrale.server.app import ServerApp
from tests.metrale.engine_helpers import assert_clean, wait_idle
from tests.metrale.model_helpers import byte_vocab, make_twins, tiny_config_dict, write_tiny_gguf
from tests.metrale.templates import HERMES_TOOLS_TEMPLATE
from tests.server.fakes import call

pytest.importorskip("llguidance")
pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]
CITY_TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
             "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A tiny random llama whose vocabulary spells any text (JSON included) and whose chat template
    writes Hermes tool calls."""
    config = tiny_config_dict(vocab_size=320, max_position_embeddings=1024)
    _, model = make_twins(config)
    path = str(tmp_path_factory.mktemp("tiny-responses") / "tiny.gguf")
    write_tiny_gguf(path, config, tree_flatten(model.parameters()), vocab=byte_vocab(320),
                    chat_template=HERMES_TOOLS_TEMPLATE)
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_path):
    config = EngineConfig(model=model_path, kv_cache_bytes=4 << 20, block_size=4, max_num_seqs=8,
                          max_num_batched_tokens=256)
    async with AsyncEngine(config) as eng:
        yield eng


@pytest.fixture
def app(engine):
    return ServerApp(engine, manage_engine=False)


@pytest_asyncio.fixture(loop_scope="module")
async def client(app):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")
    async with openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="unused", http_client=http, max_retries=0) as c:
        yield c


async def clean(engine) -> None:
    await wait_idle(engine)
    assert_clean(engine)


async def test_text_in_text_out(client, engine):
    response = await client.responses.create(model="tiny", input="hello there", max_output_tokens=6,
                                             temperature=0, extra_body={})
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output_text and response.output[0].type == "message"
    assert response.usage.output_tokens <= 6 and response.usage.input_tokens > 0
    assert response.usage.input_tokens_details.cached_tokens >= 0
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == response.status  # a message cut by max_output_tokens is incomplete too
    await clean(engine)


async def test_instructions_and_messages_reach_the_template(client, engine, app):
    plain = await client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0)
    with_instructions = await client.responses.create(model="tiny", input=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], instructions="system words",
        max_output_tokens=4, temperature=0)
    assert with_instructions.usage.input_tokens > plain.usage.input_tokens
    await clean(engine)


async def test_streamed_events_build_the_same_text(client, engine):
    kwargs = {"model": "tiny", "input": "hello there", "max_output_tokens": 8, "temperature": 0}
    full = await client.responses.create(**kwargs)
    events = [event async for event in await client.responses.create(**kwargs, stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{full.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == full.usage.output_tokens
    item_done = next(e for e in events if e.type == "response.output_item.done")
    assert item_done.item.status == events[-1].response.output[0].status == full.status
    await clean(engine)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_function_call_is_a_function_call_item(client, engine, stream):
    kwargs = {"model": "tiny", "input": "weather in Oslo?", "tools": [CITY_TOOL], "max_output_tokens": 40,
              "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0}
    if not stream:
        response = await client.responses.create(**kwargs)
    else:
        events = [e async for e in await client.responses.create(**kwargs, stream=True)]
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        response = events[-1].response
        assert deltas == response.output[-1].arguments
    (item,) = [o for o in response.output if o.type == "function_call"]
    assert item.name == "get_weather" and item.call_id
    assert json.loads(item.arguments)["city"] in ("Oslo", "Paris")  # random weights; the grammar holds
    await clean(engine)


async def test_function_call_outputs_are_accepted_as_input(client, engine):
    response = await client.responses.create(model="tiny", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12 C"}])
    assert response.status in ("completed", "incomplete")
    await clean(engine)


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning"), ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"), ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools"), ({"temperature": 5}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"), ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"), ({"text": {"format": {"type": "yaml"}}}, "text"),
])
async def test_unsupported_or_bad_fields_are_400s_naming_them(app, engine, fields, param):
    r = await call(app, "POST", "/v1/responses", {"input": "hi", **fields})
    assert r.status == 400, r.body
    assert r.json()["error"]["param"] == param
    assert_clean(engine)  # nothing was queued


async def test_a_client_leaving_mid_stream_frees_everything(app, engine):
    r = await call(app, "POST", "/v1/responses", {"input": "hi", "stream": True, "max_output_tokens": 300,
                                                  "temperature": 0}, disconnect_after_chunks=4)
    assert r.status == 200 and r.body.startswith(b"event: response.created\ndata: ")
    await clean(engine)
