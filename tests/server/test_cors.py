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


async def test_without_allowed_origins_nothing_changes():
    served = app(())
    r = await call(served, "OPTIONS", "/v1/completions", headers={"origin": ORIGIN,
                                                                   "access-control-request-method": "POST"})
    assert r.status == 401 and "access-control-allow-origin" not in r.headers
    r = await call(served, "POST", "/v1/completions", BODY, headers={"origin": "https://other.example", **KEY})
    assert r.status == 200 and "access-control-allow-origin" not in r.headers
