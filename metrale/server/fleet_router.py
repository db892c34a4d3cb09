"""sglang-router's worker API, as `metrale fleet` uses it to take a replica out of rotation and back.

    GET    /workers         {"workers": [{"id", "url", "is_healthy", ...}], ...}
    POST   /workers         {"url", "api_key"}  -> 202, registered in the background (health checked first)
    DELETE /workers/{id}    -> 202, removed in the background

With an API key the router asks for it on these routes too (Authorization: Bearer). A worker added by
POST gets the key in its body, so the router sends it on to the replica as it does for --worker-urls.
"""

from __future__ import annotations

import http.client
import json

__all__ = ["RouterAdmin", "http_get"]


def http_request(method: str, url: str, body: dict | None = None, api_key: str | None = None,
                 timeout_s: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of one request to an http:// URL, or (0, b"") when nothing answered in time."""
    host_port, _, path = url.removeprefix("http://").partition("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    payload = None
    if body is not None:
        payload = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    conn = http.client.HTTPConnection(host_port, timeout=timeout_s)
    try:
        conn.request(method, "/" + path, body=payload, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException):  # refused, reset, timed out, or a broken response
        return 0, b""
    finally:
        conn.close()


def http_get(url: str, api_key: str | None = None, timeout_s: float = 2.0) -> tuple[int, bytes]:
    return http_request("GET", url, api_key=api_key, timeout_s=timeout_s)


class RouterAdmin:
    """The worker list of one running router."""

    def __init__(self, router_url: str, api_key: str | None) -> None:
        self.router_url = router_url
        self.api_key = api_key

    def workers(self) -> list[dict] | None:
        """The router's workers, or None when it did not answer."""
        status, body = http_get(self.router_url + "/workers", self.api_key)
        if status != 200:
            return None
        return json.loads(body).get("workers", [])

    def healthy_urls(self) -> set[str]:
        """URLs of the workers the router has registered and finds healthy (empty if it did not answer)."""
        return {w["url"] for w in self.workers() or () if w.get("is_healthy")}

    def add(self, url: str) -> bool:
        """Ask the router to register `url`; True when it accepted the job."""
        body = {"url": url, **({"api_key": self.api_key} if self.api_key else {})}
        status, _ = http_request("POST", self.router_url + "/workers", body, self.api_key)
        return status in (200, 201, 202)

    def remove(self, url: str) -> bool:
        """Ask the router to drop every worker at `url`; True when none is left to ask about."""
        workers = self.workers()
        if workers is None:
            return False
        accepted = True
        for worker in workers:
            if worker["url"] == url:
                status, _ = http_request("DELETE", f"{self.router_url}/workers/{worker['id']}", api_key=self.api_key)
                accepted = accepted and status in (200, 202, 204)
        return accepted
