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


def _request(server: ServerProcess, method: str, path: str, body: bytes = b"", **headers: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in {"host": f"127.0.0.1:{server.port}", **headers, "content-length": str(len(body))}.items():
            conn.putheader(name.replace("_", "-"), value)
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_a_local_server_is_safe_from_web_pages(tiny_model):
    """DNS rebinding (a foreign Host), a foreign Origin, a preflight-free text/plain body: refused before they
    run; with a key, the router-facing routes need it too, and no response shows the model's path."""
    completion = b'{"prompt": [5, 7], "max_tokens": 2}'
    json_type = {"content_type": "application/json"}
    with ServerProcess("--model", tiny_model, "--max-model-len", "256", "--kv-cache-mib", "8", "--api-key", "k",
                       "--allowed-hosts", "gpu-box.lan") as server:
        key = {"authorization": "bearer k"}  # the scheme is case-insensitive
        assert _request(server, "POST", "/v1/completions", completion, **key, **json_type)[0] == 200
        assert _request(server, "POST", "/v1/completions", completion, host="evil.example:80", **key)[0] == 403
        assert _request(server, "POST", "/v1/completions", completion, host="gpu-box.lan:8000", **key)[0] == 200
        assert _request(server, "POST", "/v1/completions", completion, origin="https://evil.example", **key)[0] == 403
        assert _request(server, "POST", "/v1/completions", completion, content_type="text/plain", **key)[0] == 415
        for path in ("/server_info", "/model_info", "/get_load", "/v1/models"):
            assert _request(server, "GET", path)[0] == 401, path
            status, body = _request(server, "GET", path, **key)
            assert status == 200 and tiny_model.encode() not in body and b"/tmp" not in body, (path, body)
        assert _request(server, "GET", "/health")[0] == 200 and _request(server, "GET", "/metrics")[0] == 200
        assert server.metric("metrale_request_success_total", finished_reason="length") == 2  # no refused one ran
