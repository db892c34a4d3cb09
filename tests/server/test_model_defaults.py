"""The model's sampling defaults fill what a request leaves unset (chat, completions, responses); the
request's own values win; the developer role is accepted on chat completions."""

from __future__ import annotations

from metrale.server.app import ServerApp
from tests.server.fakes import FakeEngine, call

DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}


async def test_model_defaults_fill_unset_fields_and_requests_override_them():
    engine = FakeEngine()
    engine.sampling_defaults = dict(DEFAULTS)
    app = ServerApp(engine, manage_engine=False)
    chat = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            "max_tokens": 2}
    assert (await call(app, "POST", "/v1/chat/completions", chat)).status == 200
    assert (await call(app, "POST", "/v1/chat/completions", {**chat, "temperature": 0, "top_k": 0})).status == 200
    assert (await call(app, "POST", "/v1/completions", {"prompt": "a b", "max_tokens": 2, "top_p": 1.0})).status == 200
    assert (await call(app, "POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2,
                                                      "temperature": 1.0})).status == 200
    picked = [{name: getattr(params, name) for name in DEFAULTS} for _, params in engine.submitted]
    assert picked == [DEFAULTS, {**DEFAULTS, "temperature": 0.0, "top_k": 0}, {**DEFAULTS, "top_p": 1.0},
                      {**DEFAULTS, "temperature": 1.0}]


async def test_without_model_defaults_the_usual_defaults_stay():
    engine = FakeEngine()
    app = ServerApp(engine, manage_engine=False)
    r = await call(app, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2})
    assert r.status == 200
    (_, params), = engine.submitted
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
