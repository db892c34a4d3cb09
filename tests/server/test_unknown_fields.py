"""Unknown request fields: ignored, but warned about once per name and counted on /metrics; other servers' names
for metrale's fields (max_new_tokens) are a 400 pointing at the right one, so they never silently change the
result; the names remembered for the warning are capped."""

from __future__ import annotations

import logging

import pytest

from metrale.server import unknown_fields
from metrale.server.app import ServerApp
from metrale.server.unknown_fields import MAX_REMEMBERED, UnknownFields
from tests.server.fakes import FakeEngine, call

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
COUNTER = b"metrale_request_unknown_fields_total"
LOGGER = "metrale.server.unknown_fields"


def counted(metrics: bytes) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(COUNTER))
    return float(line.rsplit(b" ", 1)[1])


async def test_unknown_fields_are_served_warned_once_per_name_and_counted(caplog):
    engine = FakeEngine()
    app = ServerApp(engine, manage_engine=False)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for _ in range(2):
        r = await call(app, "POST", COMPLETIONS, {"prompt": "a b", "max_tokens": 2, "frobnicate": 1, "zz": None})
        assert r.status == 200, r.body
    r = await call(app, "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}], "frobnicate": True})
    assert r.status == 200, r.body
    warnings = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER]
    assert len(warnings) == 2
    assert "/v1/completions" in warnings[0] and "'frobnicate'" in warnings[0] and "'zz'" in warnings[1]
    assert counted((await call(app, "GET", "/metrics")).body) == 5


@pytest.mark.parametrize(("path", "field", "right"), [
    (COMPLETIONS, "max_new_tokens", "max_tokens"),
    (CHAT, "max_new_tokens", "max_tokens"),
    (CHAT, "stop_sequences", "stop"),
    (COMPLETIONS, "num_return_sequences", "n"),
    ("/v1/responses", "max_new_tokens", "max_tokens"),
])
async def test_another_servers_name_for_a_field_is_a_400_naming_the_right_one(path, field, right):
    engine = FakeEngine()
    app = ServerApp(engine, manage_engine=False)
    base = {COMPLETIONS: {"prompt": "a b"}, CHAT: {"messages": [{"role": "user", "content": "hi"}]},
            "/v1/responses": {"input": "hi"}}[path]
    r = await call(app, "POST", path, {**base, field: 40})
    assert r.status == 400, r.body
    error = r.json()["error"]
    assert error["param"] == field and f"did you mean {right}?" in error["message"]
    assert engine.submitted == []
    assert counted((await call(app, "GET", "/metrics")).body) == 1


def test_the_names_remembered_are_capped(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    record = UnknownFields("m")
    record.note([f"field_{i}" for i in range(MAX_REMEMBERED + 50)], "/v1/completions")
    record.note(["x" * 10_000], "/v1/completions")
    warnings = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER]
    assert len(warnings) == MAX_REMEMBERED + 1 and "no longer logged" in warnings[-1]
    assert len(record._warned) == MAX_REMEMBERED
    assert counted(record.exposition()) == MAX_REMEMBERED + 51


def test_long_names_are_shortened_in_the_log(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    UnknownFields("m").note(["y" * 10_000], "/v1/chat/completions")
    (message,) = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER]
    assert len(message) < 200 + unknown_fields.MAX_NAME_CHARS


async def test_a_key_that_is_not_utf8_is_a_400():
    """The struct skips an unknown key unread; reading the keys must not turn it into a 500."""
    engine = FakeEngine()
    r = await call(ServerApp(engine, manage_engine=False), "POST", COMPLETIONS,
                   b'{"\xff\xfe\xc3max_tokens": 1, "prompt": "0"}')
    assert r.status == 400, r.body
    assert engine.submitted == []
