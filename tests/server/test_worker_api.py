"""What a router or gateway reads from a replica (metrale/server/worker_api.py), in process with a
scripted engine: /server_info and /model_info as sglang-router parses them, /get_load, the vLLM-named
gauges on /metrics, and model aliases ("unknown" is what the router sends for a chat without model)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrale.outputs import EngineStats
from metrale.server.app import ServerApp
from tests.server.fakes import FakeEngine, call

MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def app(engine: FakeEngine) -> ServerApp:
    return ServerApp(engine, manage_engine=False, served_model_name="tiny-chat", model_aliases=("unknown",))


def _stats(**values) -> EngineStats:
    base = dict(health="serving", running=0, waiting=0, kv_blocks_total=100, kv_blocks_free=100, kv_usage=0.0,
                peak_kv_usage=0.0, num_preemptions=0, num_steps=0, prefix_cache_queries=0, prefix_cache_hits=0,
                requests_finished=0)
    return EngineStats(**{**base, **values})


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
async def test_server_info_names_the_served_model(app, path):
    r = await call(app, "GET", path)
    assert r.status == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    # sglang-router reads served_model_name (its worker's model id) and model_path; every field it
    # knows is optional, but a present one of the wrong type fails the whole parse.
    assert body["served_model_name"] == "tiny-chat"
    assert body["model_path"] == "tiny-chat"  # the served name: no filesystem path in any response
    assert "/models" not in r.body.decode()
    assert body["model_type"] == "llama" and body["max_model_len"] == 64 and body["kv_block_size"] == 16
    assert isinstance(body["version"], str) and "dp_size" not in body


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
async def test_model_info(app, path):
    body = (await call(app, "GET", path)).json()
    assert body == {"model_path": "tiny-chat", "served_model_name": "tiny-chat",
                    "model_type": "llama", "is_generation": True}


async def test_get_load_counts_requests_and_kv_tokens(app, engine):
    engine.stats = lambda: _stats(running=3, waiting=2, kv_blocks_free=90, kv_usage=0.1)
    body = (await call(app, "GET", "/get_load")).json()
    assert body == [{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 10 * 16}]


@pytest.mark.parametrize("path", ["/server_info", "/model_info", "/get_load"])
async def test_info_routes_are_get_only_and_behind_the_key(engine, path):
    app = ServerApp(engine, manage_engine=False, api_key="secret")
    r = await call(app, "GET", path)
    assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert (await call(app, "GET", path, headers={"authorization": "Bearer secret"})).status == 200
    r = await call(app, "POST", path, headers={"authorization": "Bearer secret"})
    assert r.status == 405 and r.json()["error"]["code"] == "method_not_allowed"


async def test_info_routes_answer_503_until_loaded(engine):
    engine.max_model_len = 0  # what AsyncEngine reports before its model is loaded
    engine.state = "loading"
    app = ServerApp(engine, manage_engine=False)
    for path in ("/server_info", "/get_model_info", "/get_load"):
        r = await call(app, "GET", path)
        assert r.status == 503 and r.json()["error"]["code"] == "loading", path
    metrics = (await call(app, "GET", "/metrics")).body.decode()
    assert "vllm:" not in metrics  # no scheduler to alias yet


async def test_metrics_carry_vllm_named_gauges_when_asked(engine):
    app = ServerApp(engine, manage_engine=False, served_model_name="tiny-chat", vllm_metric_aliases=True)
    engine.stats = lambda: _stats(running=3, waiting=7, kv_blocks_free=75, kv_usage=0.25)
    r = await call(app, "GET", "/metrics")
    assert r.status == 200
    samples = {s.name: s for f in text_string_to_metric_families(r.body.decode()) for s in f.samples}
    assert samples["vllm:num_requests_running"].value == 3
    assert samples["vllm:num_requests_waiting"].value == 7
    assert samples["vllm:kv_cache_usage_perc"].value == 0.25  # a 0..1 ratio, as in vLLM
    assert samples["vllm:num_requests_waiting"].labels == {"model_name": "tiny-chat"}
    assert "metrale_requests_waiting" in samples  # the aliases come in addition to metrale_*


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_model_alias_is_answered_as_the_served_model(app, path):
    body = {"model": "unknown", "max_tokens": 2, **({"messages": MESSAGES} if "chat" in path else {"prompt": "a b"})}
    r = await call(app, "POST", path, body)
    assert r.status == 200 and r.json()["model"] == "tiny-chat"
    assert (await call(app, "GET", "/v1/models/unknown")).json()["id"] == "tiny-chat"


async def test_other_model_names_still_404(app, engine):
    r = await call(app, "POST", "/v1/chat/completions", {"model": "gpt-4", "messages": MESSAGES})
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
    plain = ServerApp(engine, manage_engine=False)  # no alias: "unknown" is just another name
    r = await call(plain, "POST", "/v1/chat/completions", {"model": "unknown", "messages": MESSAGES})
    assert r.status == 404


async def test_router_rewritten_chat_body_is_accepted(app, engine):
    """A chat body as sglang-router forwards it: max_tokens renamed, its own defaults added."""
    body = {"model": "unknown", "messages": MESSAGES, "max_completion_tokens": 3, "logprobs": False,
            "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
            "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False, "stream": False}
    r = await call(app, "POST", "/v1/chat/completions", body)
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert engine.submitted[-1][1].max_tokens == 3


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (scripts/setup.sh installs it)")
async def test_default_metrics_pass_promtool_and_the_aliases_are_off(app, engine):
    """`promtool check metrics` exits 3 on the `vllm:` names (a colon is for recording rules), so the aliases are
    served only with --vllm-metric-aliases (metrale fleet sets it for its replicas)."""
    await call(app, "POST", "/v1/completions", {"prompt": "a b", "max_tokens": 2, "unknown_knob": 1})
    body = (await call(app, "GET", "/metrics")).body
    assert b"vllm:" not in body and b"metrale_request_unknown_fields_total" in body
    result = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
