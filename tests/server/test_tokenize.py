"""POST /tokenize and /detokenize (vLLM's shapes) and the /v1/models cards, in process with the scripted engine.
The routes against the real tokenizer and template: test_tokenize_served.py."""

from __future__ import annotations

import pytest

from metrale.server.app import ServerApp
from tests.server.fakes import FakeEngine, call


@pytest.fixture
def app() -> ServerApp:
    return ServerApp(FakeEngine(), manage_engine=False, model_aliases=("alias-a",))


async def test_tokenize_a_prompt(app):
    r = await call(app, "POST", "/tokenize", {"prompt": "a b c", "return_token_strs": True})
    assert r.status == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 64 and body["token_strs"] is not None


@pytest.mark.parametrize(("body", "field"), [
    ({}, "prompt"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ({"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False}, "add_generation_prompt"),
    ({"prompt": "x", "model": "other"}, "model"),
    ({"messages": []}, "messages"),  # the chat request's own constraint (the API fuzzer's 500)
])
async def test_tokenize_refusals_name_the_field(app, body, field):
    r = await call(app, "POST", "/tokenize", body)
    assert r.status in (400, 404) and r.json()["error"]["param"] == field


async def test_detokenize_is_bounded_by_the_context(app):
    r = await call(app, "POST", "/detokenize", {"tokens": list(range(65))})
    assert r.status == 400 and r.json()["error"]["param"] == "tokens"
    r = await call(app, "POST", "/detokenize", {"tokens": [1, 2]})
    assert r.status == 200 and r.json() == {"prompt": "<1><2>"}


async def test_token_routes_take_post_only(app):
    assert (await call(app, "GET", "/tokenize")).status == 405


async def test_the_model_card_names_its_root_and_aliases(app):
    (card,) = (await call(app, "GET", "/v1/models")).json()["data"]
    assert (card["id"], card["root"], card["max_model_len"], card["aliases"]) == ("fake-model", "fake-model", 64,
                                                                                  ["alias-a"])
    assert (await call(app, "GET", "/v1/models/alias-a")).json() == card
