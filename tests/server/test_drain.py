"""SIGTERM drains a real server: new requests and /health get 503 while the socket stays open,
an in-flight request that fits in --shutdown-timeout finishes, one that does not is aborted with an
SSE error event then [DONE], and the process exits 0."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.serve import SMALL, ServerProcess

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]


def _stream(server: ServerProcess, max_tokens: int) -> list:
    status, body = server.post("/v1/completions", json.dumps(
        {"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}).encode())
    assert status == 200
    return [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]


def test_sigterm_drains_then_exits_zero():
    with ServerProcess(*SMALL, "--shutdown-timeout", "3") as server:
        with ThreadPoolExecutor(2) as pool:
            short = pool.submit(_stream, server, 4)
            long = pool.submit(_stream, server, 500)  # far more than 3 s of steps
            # the long one running (the short one may already be done on a busy machine: it ends "length"
            # either way; waiting for both at once raced its 4 tokens)
            server.wait_for(lambda s: s.gauges()[0] >= 1 and (s.gauges()[0] == 2 or short.done()), 60, "running")
            server.proc.send_signal(signal.SIGTERM)
            server.wait_for(lambda s: s.get("/health")[0] == 503, 30, "draining")
            assert server.get("/health") == (503, b'{"status":"draining"}')
            status, body = server.post("/v1/completions", b'{"prompt": "hi", "max_tokens": 1}')
            assert status == 503 and json.loads(body)["error"]["code"] == "draining"
            short_events, long_events = short.result(), long.result()
        assert short_events[-1] == "[DONE]"
        assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        assert long_events[-1] == "[DONE]"
        assert json.loads(long_events[-2])["error"]["code"] == "aborted"
        assert server.proc.wait(30) == 0
        assert "drained; shutting down" in server.logs()
