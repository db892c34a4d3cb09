"""`metrale serve` listening on several addresses at once, with CORS, as a real process on a tiny model."""

from __future__ import annotations

import http.client
import socket

import pytest

from tests.server.serve import ServerProcess

pytestmark = pytest.mark.timeout(180)


def ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_serves_on_every_host_with_cors(tiny_model):
    with ServerProcess("--model", tiny_model, "--max-model-len", "256", "--kv-cache-mib", "8", "--host", "::1",
                       "--api-key", "k", "--allowed-origins", "https://app.example") as server:
        for host in ("127.0.0.1", "::1"):
            conn = http.client.HTTPConnection(host, server.port, timeout=30)
            try:
                conn.request("OPTIONS", "/v1/completions", headers={
                    "origin": "https://app.example", "access-control-request-method": "POST"})
                preflight = conn.getresponse()
                preflight.read()
                conn.request("POST", "/v1/completions", body=b'{"prompt": [5, 7], "max_tokens": 2}',
                             headers={"origin": "https://app.example", "authorization": "Bearer k",
                                      "content-type": "application/json"})
                answer = conn.getresponse()
                answer.read()
            finally:
                conn.close()
            assert preflight.status == 204, host
            assert answer.status == 200 and answer.getheader("access-control-allow-origin") == "https://app.example"
