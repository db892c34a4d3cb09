"""GET /openapi.json (metrale/server/openapi.py): generated from the msgspec request types, every route the
app answers is in it with every status it can give, the key's security only when a key is set, and
Schemathesis loads it (tests/server/test_api_fuzz.py then fuzzes a real server from it)."""

from __future__ import annotations

import msgspec
import pytest

from metrale.server import worker_api
from metrale.server.app import ServerApp
from metrale.server.openapi import openapi_document
from metrale.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.fakes import FakeEngine, call

POSTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
         "/tokenize", "/detokenize", "/api/chat", "/api/generate", "/api/show", "/v1/embeddings", "/api/embed",
         "/api/embeddings")
GETS = ("/health", "/metrics", "/v1/models", "/v1/models/{model}", "/openapi.json", *worker_api.INFO_PATHS,
        "/", "/api/version", "/api/tags", "/api/ps")


async def test_the_route_serves_the_document():
    r = await call(ServerApp(FakeEngine(), manage_engine=False), "GET", "/openapi.json")
    assert r.status == 200 and r.headers["content-type"] == "application/json"
    document = r.json()
    assert document["openapi"].startswith("3.1") and set(document["paths"]) == {*POSTS, *GETS}
    assert document["paths"]["/v1/models/{model}"]["parameters"][0]["example"] == "fake-model"


def test_request_bodies_are_the_msgspec_types():
    document = openapi_document(api_key=False, model="m")
    schemas = document["components"]["schemas"]
    _, expected = msgspec.json.schema_components([CompletionRequest, ChatCompletionRequest],
                                                 ref_template="#/components/schemas/{name}")
    assert all(schemas[name] == schema for name, schema in expected.items())
    chat = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert chat["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert schemas["ChatCompletionRequest"]["properties"]["n"]["maximum"] == 128  # bounds travel with the types


def test_every_status_is_documented_and_none_is_a_catch_all():
    document = openapi_document(api_key=False, model="m")
    for path in POSTS:
        statuses = set(document["paths"][path]["post"]["responses"])
        assert statuses == {"200", "400", "401", "403", "404", "408", "413", "415", "429", "500", "503"}, path
    for path in GETS:
        assert "default" not in document["paths"][path]["get"]["responses"] and \
            "403" in document["paths"][path]["get"]["responses"]


@pytest.mark.parametrize("api_key", [False, True])
def test_security_only_with_a_key(api_key):
    document = openapi_document(api_key=api_key, model="m")
    security = {path: item[next(iter(k for k in item if k != "parameters"))].get("security")
                for path, item in document["paths"].items()}
    if not api_key:
        assert set(security.values()) == {None} and "securitySchemes" not in document["components"]
        return
    assert security.pop("/health") == security.pop("/metrics") == []
    assert all(value == [{"bearer": []}] for value in security.values())
    assert document["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}


def test_schemathesis_loads_every_operation():
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_dict(openapi_document(api_key=True, model="m"))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == len(POSTS) + len(GETS)
