"""Backpressure: with one running and one waiting slot, 10 concurrent requests give exactly 2
successes and 8 HTTP 429s with an OpenAI error body (real engine, real server)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.serve import SMALL, ServerProcess

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]
BODY = json.dumps({"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}).encode()


@pytest.fixture(scope="module")
def server():
    with ServerProcess(*SMALL, "--max-num-seqs", "1", "--max-waiting", "1") as server:
        yield server


def test_ten_concurrent_requests_two_succeed_eight_get_429(server):
    rejected_before = server.metric("metrale_requests_rejected_total", reason="queue_full")
    with ThreadPoolExecutor(10) as pool:
        first = pool.submit(server.post, "/v1/completions", BODY)
        # The first request holds the one running slot before the other nine arrive together,
        # so exactly one of them can wait and eight find the queue full.
        server.wait_for(lambda s: s.gauges()[0] == 1, 30, "first request running")
        rest = [pool.submit(server.post, "/v1/completions", BODY) for _ in range(9)]
        results = [first.result()] + [f.result() for f in rest]
    statuses = sorted(status for status, _ in results)
    assert statuses == [200, 200] + [429] * 8
    for status, body in results:
        if status == 429:
            error = json.loads(body)["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
        else:
            assert json.loads(body)["usage"]["completion_tokens"] == 24
    assert server.metric("metrale_requests_rejected_total", reason="queue_full") - rejected_before == 8
    server.wait_for(lambda s: s.idle(), 60, "idle")


def test_serial_requests_all_succeed(server):
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 3}).encode()
    assert [server.post("/v1/completions", body)[0] for _ in range(3)] == [200] * 3
