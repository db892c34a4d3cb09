"""Structured outputs and token masks over HTTP on the real default model (official openai client, a real
`metrale serve`): every output parses and validates against its schema, streamed and not, while
unconstrained requests share the batch; an invalid schema is a 400 naming the problem; max_tokens in
the middle of an object ends with finish_reason "length"."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.server.serve import SMALL, ServerProcess

pytest.importorskip("llguidance")
pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

NESTED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{4,5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "address"], "additionalProperties": False}
ENUMS = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "size": {"type": "string", "enum": ["S", "M", "L"]},
                                          "in_stock": {"type": "boolean"}},
         "required": ["color", "size", "in_stock"], "additionalProperties": False}
ARRAYS = {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                      "minItems": 2, "maxItems": 4},
                                           "counts": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99}, "maxItems": 3}},
          "required": ["fruits", "counts"], "additionalProperties": False}
REQUIRED = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                             "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                             "note": {"type": "string", "maxLength": 10}},
            "required": ["title", "year"], "additionalProperties": False}
CASES = [("Describe a person living in Oslo as JSON.", NESTED), ("Describe a T-shirt for sale as JSON.", ENUMS),
         ("List some fruits and counts as JSON.", ARRAYS), ("Give a film and its year as JSON.", REQUIRED)]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(*SMALL, "--max-num-seqs", "16", "--served-model-name", "m") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300) as client:
        yield client  # closed with the module: no connection is left for the garbage collector


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def constrained(aclient, prompt: str, schema: dict, stream: bool, seed: int) -> tuple[str, str]:
    kwargs = dict(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=150, temperature=0.8,
                  seed=seed, response_format=response_format(schema))
    if not stream:
        out = await aclient.chat.completions.create(**kwargs)
        return out.choices[0].message.content, out.choices[0].finish_reason
    text, finish = [], None
    async for chunk in await aclient.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


async def free(aclient, seed: int) -> str:
    out = await aclient.completions.create(model="m", prompt="Once upon a time", max_tokens=40, temperature=0.8,
                                           seed=seed, extra_body={"ignore_eos": True})
    return out.choices[0].finish_reason


def test_schemas_validate_streamed_and_not_in_a_batch_with_free_requests(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                                      timeout=300) as aclient:
            jobs = [constrained(aclient, prompt, schema, stream, seed)
                    for seed in range(2) for stream in (False, True) for prompt, schema in CASES]
            return await asyncio.gather(*jobs, *(free(aclient, seed) for seed in range(4)))

    results = asyncio.run(run())
    outputs, frees = results[:-4], results[-4:]
    schemas = [schema for _seed in range(2) for _stream in (False, True) for _, schema in CASES]
    for (text, finish), schema in zip(outputs, schemas):
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), schema)
    assert frees == ["length"] * 4


def test_json_object_on_both_endpoints(client):
    dog = [{"role": "user", "content": "Describe a dog as JSON with keys name and breed."}]
    chat = client.chat.completions.create(model="m", messages=dog,
                                          max_tokens=120, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    text = client.completions.create(model="m", prompt="A JSON object describing a dog:", max_tokens=120,
                                     temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert text.choices[0].finish_reason == "stop" and isinstance(json.loads(text.choices[0].text), dict)


def test_vllm_guided_fields(client):
    def ask(extra: dict, prompt: str = "Is the sky blue? Answer:") -> str:
        (choice,) = client.completions.create(model="m", prompt=prompt, max_tokens=40, temperature=0.7, seed=3,
                                              extra_body=extra).choices
        assert choice.finish_reason == "stop", choice
        return choice.text

    assert ask({"guided_choice": ["yes", "no", "maybe so"]}) in ("yes", "no", "maybe so")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", ask({"guided_regex": r"\d{3}-\d{4}"}, "Phone number:"))
    assert re.fullmatch(r"(red|blue)( and (red|blue))?\.", ask({"structured_outputs": {
        "grammar": 'start: c (" and " c)? "."\nc: "red" | "blue"'}}, "Colors:"))
    assert ask({"guided_grammar": 'root ::= "up" | "down"'}, "Direction:") in ("up", "down")  # GBNF
    jsonschema.validate(json.loads(ask({"guided_json": REQUIRED}, "A film as JSON:")), REQUIRED)


def test_invalid_schema_is_a_400_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       response_format=response_format({"type": "object", "properties": {
                                           "a": {"type": "strnig"}}}))
    body = error.value.body
    assert "Invalid type: strnig" in body["message"] and body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        client.completions.create(model="m", prompt="x", extra_body={"guided_regex": "(ab"})


def test_max_tokens_in_the_middle_of_an_object_ends_with_length(client):
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "A person as JSON."}],
                                         max_tokens=6, temperature=0, response_format=response_format(NESTED))
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "A person as JSON."}],
                                                 max_tokens=6, temperature=0, stream=True,
                                                 response_format=response_format(NESTED)))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logit_bias_and_allowed_token_ids_over_http(client):
    forced = client.completions.create(model="m", prompt="The capital of France is", max_tokens=3, temperature=0,
                                       logit_bias={"28": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == ",,,"  # id 28 is ","
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="m", prompt="x", logit_bias={"99999999": 1})
    allowed = client.completions.create(model="m", prompt="Count:", max_tokens=8, temperature=1.0, seed=2,
                                        extra_body={"allowed_token_ids": [28, 29, 30], "ignore_eos": True})
    assert len(allowed.choices[0].text) == 8 and set(allowed.choices[0].text) <= set(",-.")  # ids 28, 29, 30
