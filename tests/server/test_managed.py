"""The multi-model server in process (managed.py over metrale.manager, engine doubles): each request's model is
resolved once and loaded on demand; /v1/models, /api/tags and /api/ps list the models; keep_alive; failed loads and
a full budget are clear errors; /metrics merges the engines' series; /health before any load."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import pytest

from metrale.server.app import ServerApp
from metrale.server.managed import ManagedModels
from tests.metrale.manager.fakes import make_manager
from tests.server.fakes import call


@pytest.fixture
async def served():
    """Models a, b, c (100 MB each, a budget for two) behind a ServerApp; its manager and engine factory."""
    manager, factory, clock = make_manager({"a": 100, "b": 100, "c": 100}, 250)
    models = ManagedModels(manager)
    app = ServerApp(models=models, manage_engine=False)
    await models.start()
    yield app, manager, factory
    await models.shutdown()


async def _complete(app, model, **body):
    return await call(app, "POST", "/v1/completions", {"model": model, "prompt": "x y", "max_tokens": 2, **body})


async def test_models_are_listed_before_any_load_and_health_is_serving(served):
    app, _, factory = served
    assert (await call(app, "GET", "/health")).json() == {"status": "serving"}
    cards = (await call(app, "GET", "/v1/models")).json()["data"]
    assert [(c["id"], c["status"], c["size"], c["max_model_len"]) for c in cards] == [
        ("a", "unloaded", 100 << 20, None), ("b", "unloaded", 100 << 20, None), ("c", "unloaded", 100 << 20, None)]
    assert factory.built == []


async def test_a_request_loads_its_model_and_holds_it_until_its_response_ends(served):
    app, manager, factory = served
    r = await _complete(app, "b")
    assert r.status == 200 and r.json()["model"] == "b"
    assert (await call(app, "GET", "/v1/models/b")).json()["status"] == "loaded"
    assert (await call(app, "GET", "/v1/models/a")).json()["status"] == "unloaded"
    assert [e.entry.model_id for e in factory.built] == ["b"] and manager.slots["b"].leases == 0
    stream = await _complete(app, "b", stream=True)
    assert stream.events()[-1] == "[DONE]" and manager.slots["b"].leases == 0
    chat = await call(app, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status == 200 and chat.json()["model"] == "a"  # no model: the default (first) one


async def test_an_unknown_model_is_a_404_naming_the_served_ones(served):
    app, _, _ = served
    r = await _complete(app, "nope")
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "this server serves 3 models: 'a', 'b', 'c'" in r.json()["error"]["message"]


async def test_a_failed_load_is_a_503_with_the_loaders_message_and_the_others_keep_serving(served):
    app, _, factory = served
    assert (await _complete(app, "a")).status == 200
    factory.failures["b"] = ValueError("b.gguf: unknown GGUF magic b'JUNK'")
    r = await _complete(app, "b")
    assert r.status == 503 and r.json()["error"]["code"] == "model_load_failed"
    assert "unknown GGUF magic" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"
    assert (await call(app, "GET", "/v1/models/b")).json()["status"] == "failed"
    assert (await _complete(app, "a")).status == 200
    assert (await _complete(app, "b")).status == 200  # tried again on the next request


async def test_no_room_while_every_resident_model_is_busy_is_a_503(served):
    app, manager, _ = served
    held = [await manager.acquire("a"), await manager.acquire("b")]
    r = await _complete(app, "c")
    assert r.status == 503 and r.json()["error"]["code"] == "no_room"
    for lease in held:
        lease.release()
    assert (await _complete(app, "c")).status == 200


async def test_ollama_tags_ps_and_keep_alive(served):
    app, manager, factory = served
    tags = (await call(app, "GET", "/api/tags")).json()["models"]
    assert [(m["name"], m["size"]) for m in tags] == [("a", 100 << 20), ("b", 100 << 20), ("c", 100 << 20)]
    assert (await call(app, "GET", "/api/ps")).json() == {"models": []}
    body = {"model": "b", "prompt": "x", "stream": False, "options": {"num_predict": 2}}
    assert (await call(app, "POST", "/api/generate", {**body, "keep_alive": "10m"})).status == 200
    (ps,) = (await call(app, "GET", "/api/ps")).json()["models"]
    assert ps["name"] == "b" and ps["size"] == 100 << 20 and ps["expires_at"] != "9999-12-31T23:59:59Z"
    assert (await call(app, "POST", "/api/generate", {**body, "keep_alive": -1})).status == 200
    assert (await call(app, "GET", "/api/ps")).json()["models"][0]["expires_at"] == "9999-12-31T23:59:59Z"
    assert (await call(app, "POST", "/api/generate", {**body, "keep_alive": 0})).status == 200
    await manager.slots["b"].unloading  # keep_alive 0: unloaded once the request ended
    assert (await call(app, "GET", "/api/ps")).json() == {"models": []} and factory.built[0].shutdowns == 1
    bad = await call(app, "POST", "/api/generate", {**body, "keep_alive": "soon"})
    assert bad.status == 400 and "keep_alive" in bad.json()["error"]


async def test_every_surface_resolves_through_the_manager(served):
    app, _, factory = served
    for path, body in (("/tokenize", {"model": "c", "prompt": "x y"}),
                       ("/v1/messages", {"model": "c", "max_tokens": 2,
                                         "messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/responses", {"model": "c", "input": "x", "max_output_tokens": 2}),
                       ("/api/chat", {"model": "c:latest", "messages": [{"role": "user", "content": "x"}],
                                      "stream": False, "options": {"num_predict": 2}})):
        assert (await call(app, "POST", path, body)).status == 200, path
    assert [e.entry.model_id for e in factory.built] == ["c"]
    assert (await call(app, "GET", "/server_info")).status == 404  # describes one model


USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": "b", "prompt": "x", "temperature": -1}),
    ("/v1/completions", {"model": "b", "prompt": "x", "stop": [""]}),
    ("/v1/chat/completions", {"model": "b", "messages": USER, "top_p": 2}),
    ("/v1/responses", {"model": "b", "input": "x", "temperature": -1}),
    ("/v1/messages", {"model": "b", "max_tokens": 2, "messages": USER, "top_k": -5}),
    ("/api/chat", {"model": "b", "messages": USER, "stream": False, "options": {"top_p": 2}}),
    ("/tokenize", {"model": "b", "prompt": "x", "messages": USER}),
    ("/tokenize", {"model": "b", "prompt": "x", "add_special_tokens": False}),
])
async def test_a_bad_body_is_a_400_before_its_model_loads(served, path, body):
    app, _, factory = served
    r = await call(app, "POST", path, body)
    assert r.status == 400, (r.status, r.body)
    assert factory.built == []


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/embeddings", {"model": "b", "input": []}),
    ("/v1/embeddings", {"model": "b", "input": "x", "dimensions": 0}),
    ("/v1/embeddings", {"model": "b", "input": ["x"] * 2049}),
    ("/api/embed", {"model": "b", "input": "x", "dimensions": 0}),
    ("/api/embed", {"model": "b", "input": ["x"] * 2049}),
])
async def test_a_bad_embedding_body_is_a_400_before_its_model_loads(path, body):
    manager, factory, _ = make_manager({"a": 100, "b": 100}, 250)
    models = ManagedModels(manager)
    app = ServerApp(models=models, manage_engine=False, task="embed")
    await models.start()
    try:
        r = await call(app, "POST", path, body)
        assert r.status == 400, (r.status, r.body)
        assert factory.built == []
    finally:
        await models.shutdown()


async def test_metrics_merge_every_engine_under_its_model_id(served):
    app, _, _ = served
    for model in ("a", "b"):
        assert (await _complete(app, model)).status == 200
    await _complete(app, "nope")  # a rejection before any model: counted by the manager
    body = (await call(app, "GET", "/metrics")).body.decode()
    assert body.count("# TYPE metrale_requests_running gauge") == 1
    assert 'metrale_requests_running{model_name="a"}' in body and 'metrale_requests_running{model_name="b"}' in body
    assert 'metrale_model_loads_total{model_name="b",outcome="ok"} 1.0' in body
    assert 'metrale_requests_rejected_total{model_name="",reason="invalid_request"} 1.0' in body
    if shutil.which("promtool") is not None:
        result = subprocess.run(["promtool", "check", "metrics"], input=body.encode(), capture_output=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


async def test_ollama_empty_prompt_loads_and_with_keep_alive_zero_unloads(served):
    app, manager, factory = served
    r = await call(app, "POST", "/api/generate", {"model": "c", "stream": False})
    assert r.status == 200 and (r.json()["done"], r.json()["done_reason"], r.json()["response"]) == (True, "load", "")
    assert manager.slots["c"].status == "loaded" and factory.built[0].submitted == []
    r = await call(app, "POST", "/api/generate", {"model": "c", "keep_alive": 0})
    assert r.json()["done_reason"] == "unload"
    await manager.slots["c"].unloading
    assert manager.slots["c"].status == "unloaded"
    r = await call(app, "POST", "/api/generate", {"model": "c", "keep_alive": 0})  # not resident: not loaded first
    assert r.json()["done_reason"] == "unload" and len(factory.built) == 1
    assert (await call(app, "POST", "/api/generate", {"model": "nope"})).status == 404


async def test_a_rejection_after_resolution_is_counted_on_that_model(served):
    app, _, _ = served
    assert (await call(app, "POST", "/v1/completions", {"model": "a", "prompt": "x", "n": 0})).status == 400
    r = await call(app, "POST", "/v1/completions", {"model": "a", "prompt": ["x", "y"], "echo": True})
    assert r.status == 400 and "echo" in r.json()["error"]["message"]  # refused once "a" was resolved
    body = (await call(app, "GET", "/metrics")).body.decode()
    assert 'metrale_requests_rejected_total{model_name="a",reason="invalid_request"} 1.0' in body
    assert 'metrale_requests_rejected_total{model_name="",reason="invalid_request"} 1.0' in body  # the bad body


async def test_concurrent_first_requests_share_one_load_and_a_client_that_leaves_returns_its_lease(served):
    app, manager, factory = served
    factory.gates["b"] = gate = asyncio.Event()
    pending = [asyncio.create_task(_complete(app, "b")) for _ in range(3)]
    while manager.slots["b"].waiting < 3:
        await asyncio.sleep(0.01)
    gate.set()
    assert [r.status for r in await asyncio.gather(*pending)] == [200, 200, 200] and len(factory.built) == 1
    factory.built[0].step_s = 0.05
    left = await call(app, "POST", "/v1/completions", {"model": "b", "prompt": "x", "max_tokens": 20, "stream": True},
                      disconnect_after_chunks=1)
    assert left.status == 200 and manager.slots["b"].leases == 0
