"""LoRA adapters over HTTP (metrale/server/lora.py): adapters listed as models, `model: NAME` runs the base with
the adapter, the runtime load/unload routes with vLLM's shapes and errors behind their flag and the API key;
and a real `metrale serve --lora-modules` (the engine process) answering for its adapter."""

from __future__ import annotations

import asyncio
import json

import pytest

from metrale import AsyncEngine, EngineConfig, SamplingParams
from metrale.loading import load_model
from metrale.server.app import ServerApp
from metrale.errors import InvalidLoraAdapterError
from metrale.server.lora import LoraModule, parse_lora_module, register
from tests.metrale.engine_helpers import assert_clean, wait_idle
from tests.metrale.lora_helpers import random_adapter, write_mlx_adapter, write_peft_adapter
from tests.server.fakes import FakeEngine, call
from tests.server.serve import ServerProcess
from tests.server.tiny_engine import engine  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.timeout(120)]
ON_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")
KEY = {"authorization": "Bearer sk-test"}
PROMPT = "hello there"


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    model_config = load_model(tiny_model).config
    root = tmp_path_factory.mktemp("server-adapters")
    return {"A": str(write_mlx_adapter(root / "A", random_adapter(model_config, 4, seed=1), rank=4, scale=2.0)),
            "B": str(write_peft_adapter(root / "B", random_adapter(model_config, 8, seed=2), rank=8, alpha=16.0))}




def completion(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@ON_MODULE_LOOP
async def test_load_use_list_and_unload_an_adapter(engine, adapters):
    app = ServerApp(engine, manage_engine=False, api_key="sk-test", enable_runtime_lora_updating=True)
    base = engine.model_name
    r = await call(app, "POST", "/v1/load_lora_adapter", {"lora_name": "A", "lora_path": adapters["A"]}, KEY)
    assert (r.status, r.body) == (200, b"Success: LoRA adapter 'A' added successfully.")
    cards = (await call(app, "GET", "/v1/models", headers=KEY)).json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [(base, None, base), ("A", base, adapters["A"])]
    assert (await call(app, "GET", "/v1/models/A", headers=KEY)).json()["parent"] == base

    r = await call(app, "POST", "/v1/completions", completion("A"), KEY)
    assert r.status == 200 and r.json()["model"] == "A"
    want = await engine.complete(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), lora="A")
    assert r.json()["choices"][0]["text"] == want.text
    base_text = (await call(app, "POST", "/v1/completions", completion(base), KEY)).json()["choices"][0]["text"]
    assert base_text != want.text
    chat = {"model": "A", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert (await call(app, "POST", "/v1/chat/completions", chat, KEY)).json()["model"] == "A"
    r = await call(app, "POST", "/tokenize", {"model": "A", "prompt": PROMPT}, KEY)  # the base's tokenizer
    assert r.status == 200 and r.json()["count"] > 0
    anthropic = {"model": "A", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = await call(app, "POST", "/v1/messages", anthropic, KEY)
    assert r.status == 200 and r.json()["model"] == "A"
    r = await call(app, "POST", "/api/chat", {**anthropic, "stream": False}, KEY)
    assert r.status == 200 and r.json()["model"] == "A"

    r = await call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "A"}, KEY)
    assert (r.status, r.body) == (200, b"Success: LoRA adapter 'A' removed successfully.")
    r = await call(app, "POST", "/v1/completions", completion("A"), KEY)
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
    assert [c["id"] for c in (await call(app, "GET", "/v1/models", headers=KEY)).json()["data"]] == [base]
    await wait_idle(engine)
    assert_clean(engine)


@ON_MODULE_LOOP
async def test_route_errors_follow_vllm(engine, adapters, tmp_path):
    app = ServerApp(engine, manage_engine=False, api_key="sk-test", enable_runtime_lora_updating=True)
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    assert (await call(app, "POST", load, {"lora_name": "B", "lora_path": adapters["B"]})).status == 401
    r = await call(app, "POST", load, {"lora_name": "B"}, KEY)
    assert r.status == 400 and r.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    (tmp_path / "adapter_config.json").write_text(json.dumps({"lora_parameters": {"rank": 4, "scale": 1.0}}))
    r = await call(app, "POST", load, {"lora_name": "bad", "lora_path": str(tmp_path)}, KEY)
    assert r.status == 400 and "adapters.safetensors" in r.json()["error"]["message"]
    assert (await call(app, "POST", load, {"lora_name": "B", "lora_path": adapters["B"]}, KEY)).status == 200
    r = await call(app, "POST", load, {"lora_name": "B", "lora_path": adapters["B"]}, KEY)
    assert r.status == 400 and r.json()["error"]["message"] == "The lora adapter 'B' has already been loaded."
    assert (await call(app, "POST", unload, {"lora_name": "B"}, KEY)).status == 200
    r = await call(app, "POST", unload, {"lora_name": "B"}, KEY)
    assert r.status == 404 and r.json()["error"]["message"] == "The lora adapter 'B' cannot be found."
    assert (await call(app, "POST", unload, {}, KEY)).status == 400
    assert (await call(app, "GET", load, headers=KEY)).status == 405
    closed = ServerApp(engine, manage_engine=False)  # without the flag the routes do not exist
    assert (await call(closed, "POST", load, {"lora_name": "B", "lora_path": adapters["B"]})).status == 404
    assert load not in (await call(closed, "GET", "/openapi.json")).json()["paths"]
    documented = (await call(app, "GET", "/openapi.json", headers=KEY)).json()["paths"]
    assert documented[load]["post"]["operationId"] == "loadLoraAdapter" and unload in documented
    assert engine.list_loras() == {}


async def test_loading_past_max_lora_adapters_is_a_400_naming_the_limit(tiny_model, adapters):
    async with AsyncEngine(EngineConfig(model=tiny_model, kv_cache_bytes=2 << 20, block_size=4,
                                        max_lora_adapters=1)) as engine:
        app = ServerApp(engine, manage_engine=False, enable_runtime_lora_updating=True)
        load = "/v1/load_lora_adapter"
        assert (await call(app, "POST", load, {"lora_name": "A", "lora_path": adapters["A"]})).status == 200
        r = await call(app, "POST", load, {"lora_name": "B", "lora_path": adapters["B"]})
        assert r.status == 400 and r.json()["error"]["param"] == "lora_name"
        assert "at most 1 LoRA adapters are registered (max_lora_adapters)" in r.json()["error"]["message"]
        assert engine.list_loras() == {"A": adapters["A"]}


@ON_MODULE_LOOP
async def test_startup_adapters_must_fit_the_served_model(engine, adapters, tmp_path):
    with pytest.raises(ValueError, match="is for base model 'other'"):
        await register(engine, (LoraModule("A", adapters["A"], "other"),), engine.model_name)
    with pytest.raises(InvalidLoraAdapterError, match="not a folder"):
        await register(engine, (LoraModule("X", str(tmp_path / "none")),), engine.model_name)
    await register(engine, (LoraModule("A", adapters["A"], engine.model_name),), engine.model_name)
    assert engine.list_loras() == {"A": adapters["A"]} and engine.remove_lora("A")


def test_lora_modules_flag_takes_name_path_and_vllm_json():
    assert parse_lora_module("sql=/a/b") == LoraModule("sql", "/a/b")
    assert parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "m"}') == LoraModule("sql", "/a", "m")
    for bad in ("sql", "=/a", '{"name": "x"}', '{"name": "x", "path": "/a", "other": 1}', "{bad json"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)


class GatedLoraEngine(FakeEngine):
    """A started engine whose add_lora waits for `gate`: startup adapter registration that takes a while."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.loras: dict[str, str] = {}

    async def add_lora(self, name: str, path: str) -> None:
        await self.gate.wait()
        self.loras[name] = path

    def list_loras(self) -> dict[str, str]:
        return dict(self.loras)


async def test_health_is_loading_until_the_startup_adapters_are_registered():
    """A server whose engine runs but whose --lora-modules are still being registered must not say "serving":
    a client waiting for /health would find only some of them (seen on a busy machine)."""
    engine = GatedLoraEngine()
    app = ServerApp(engine, lora_modules=(LoraModule("A", "/a"), LoraModule("B", "/b")))
    lifespan: asyncio.Queue = asyncio.Queue()
    sent: asyncio.Queue = asyncio.Queue()
    await lifespan.put({"type": "lifespan.startup"})
    runner = asyncio.create_task(app({"type": "lifespan"}, lifespan.get, sent.put))
    assert (await asyncio.wait_for(sent.get(), 30))["type"] == "lifespan.startup.complete"
    await asyncio.wait_for(_until(lambda: engine.state == "serving"), 30)  # the engine itself is up
    r = await call(app, "GET", "/health")
    assert r.status == 503 and r.json() == {"status": "loading"}
    engine.gate.set()
    await asyncio.wait_for(app._start_task, 30)
    r = await call(app, "GET", "/health")
    assert r.status == 200 and engine.list_loras() == {"A": "/a", "B": "/b"}
    await lifespan.put({"type": "lifespan.shutdown"})
    await asyncio.wait_for(runner, 30)


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


def test_served_with_lora_modules_in_the_engine_process(tiny_model, adapters):
    with ServerProcess("--model", tiny_model, "--kv-cache-mib", "4", "--lora-modules", f"A={adapters['A']}",
                       "--lora-modules", json.dumps({"name": "B", "path": adapters["B"]})) as server:
        status, body = server.get("/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]][1:] == ["A", "B"]
        texts = {}
        for model in ("A", "B", json.loads(body)["data"][0]["id"]):
            status, reply = server.post_json("/v1/completions", completion(model))
            assert status == 200 and reply["model"] == model
            texts[model] = reply["choices"][0]["text"]
        assert len(set(texts.values())) == 3
        status, reply = server.post_json("/v1/load_lora_adapter", {"lora_name": "C", "lora_path": adapters["A"]})
        assert status == 404  # no --enable-runtime-lora-updating


@ON_MODULE_LOOP
async def test_an_embedding_request_naming_an_adapter_is_refused(engine, adapters):
    app = ServerApp(engine, manage_engine=False, task="embed", api_key="sk-test", enable_runtime_lora_updating=True)
    r = await call(app, "POST", "/v1/load_lora_adapter", {"lora_name": "A", "lora_path": adapters["A"]}, KEY)
    assert r.status == 200
    try:
        r = await call(app, "POST", "/v1/embeddings", {"model": "A", "input": "hello"}, KEY)
        assert r.status == 400 and "LoRA adapter" in r.json()["error"]["message"]
        r = await call(app, "POST", "/api/embed", {"model": "A", "input": "hello"}, KEY)
        assert r.status == 400
        r = await call(app, "POST", "/v1/embeddings", {"model": engine.model_name, "input": "hello"}, KEY)
        assert r.status == 200 and len(r.json()["data"]) == 1  # the base model embeds
    finally:
        await call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "A"}, KEY)
    await wait_idle(engine)
    assert_clean(engine)
