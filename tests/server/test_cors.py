"""CORS: preflights answered before authentication, allowed origins on every response (errors too),
the API key still required on actual requests, other origins get nothing."""

from __future__ import annotations

import pytest

from metrale.server.app import ServerApp
from tests.server.fakes import FakeEngine, call

ORIGIN = "https://app.example"
BODY = {"prompt": "a b", "max_tokens": 2}
KEY = {"authorization": "Bearer secret"}


def app(origins: tuple[str, ...]) -> ServerApp:
    return ServerApp(FakeEngine(), api_key="secret", allowed_origins=origins, manage_engine=False)


async def test_a_preflight_from_an_allowed_origin_is_answered_without_the_key():
    r = await call(app((ORIGIN,)), "OPTIONS", "/v1/chat/completions", headers={
        "origin": ORIGIN, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})
    assert r.status == 204
    assert r.headers["access-control-allow-origin"] == ORIGIN and r.headers["vary"] == "origin"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"


async def test_a_preflight_from_another_origin_is_refused():
    r = await call(app((ORIGIN,)), "OPTIONS", "/v1/completions", headers={
        "origin": "https://evil.example", "access-control-request-method": "POST"})
    assert r.status == 403 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize(("origins", "allowed"), [((ORIGIN,), ORIGIN), (("*",), "*")])
async def test_actual_requests_need_the_key_and_carry_the_origin(origins, allowed):
    served = app(origins)
    r = await call(served, "POST", "/v1/completions", BODY, headers={"origin": ORIGIN})
    assert r.status == 401 and r.headers["access-control-allow-origin"] == allowed  # the page can read why
    r = await call(served, "POST", "/v1/completions", BODY, headers={"origin": ORIGIN, **KEY})
    assert r.status == 200 and r.headers["access-control-allow-origin"] == allowed
    r = await call(served, "POST", "/v1/completions", {**BODY, "stream": True}, headers={"origin": ORIGIN, **KEY})
    assert r.status == 200 and r.headers["access-control-allow-origin"] == allowed


async def test_without_allowed_origins_other_origins_are_refused_before_anything_runs():
    engine = FakeEngine()
    served = ServerApp(engine, api_key="secret", manage_engine=False)
    r = await call(served, "OPTIONS", "/v1/completions", headers={"origin": ORIGIN,
                                                                   "access-control-request-method": "POST"})
    assert r.status == 403 and "access-control-allow-origin" not in r.headers
    # a page's fetch (or a text/plain form) was executed, only its answer hidden: now it is refused
    r = await call(served, "POST", "/v1/completions", BODY, headers={"origin": "https://other.example", **KEY})
    assert r.status == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers and engine.submitted == []


async def test_a_disallowed_origin_is_refused_on_every_route():
    served = app((ORIGIN,))
    for method, path in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
                         ("POST", "/v1/chat/completions")):
        r = await call(served, method, path, headers={"origin": "https://evil.example", **KEY})
        assert r.status == 403 and "access-control-allow-origin" not in r.headers, path


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000"])
async def test_the_servers_own_origin_is_allowed(host):
    engine = FakeEngine()
    served = ServerApp(engine, manage_engine=False)
    r = await call(served, "POST", "/v1/completions", BODY, headers={"origin": f"http://{host}", "host": host})
    assert r.status == 200 and len(engine.submitted) == 1
    r = await call(served, "POST", "/v1/completions", BODY, headers={"origin": "http://127.0.0.1:9999", "host": host})
    assert r.status == 403  # another port is another origin
