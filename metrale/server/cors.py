"""CORS for browser clients: which origins may call the API, and the preflight answer.

    --allowed-origins "https://app.example,https://admin.example"   or   "*"

A cross-origin request from an allowed origin gets `access-control-allow-origin` (the origin itself,
with `vary: origin`, or `*`) on every response, errors included, so the page can read them. A
preflight (OPTIONS with access-control-request-method) is answered 204 here, before authentication:
browsers never send credentials on it. The actual request still needs the API key. A request from any
other origin is refused with a 403 before it is read (`refuses`), on every route: without it, a page's
`fetch` would still run (the browser only hides the answer). The server's own origin (an Origin that
names the request's Host, as a browser sends on a same-origin POST) is always allowed.
"""

from __future__ import annotations

from metrale.server.asgi import Scope, header

ALLOWED_METHODS = b"GET, POST, OPTIONS"
DEFAULT_ALLOWED_HEADERS = b"authorization, content-type, x-request-id"
PREFLIGHT_MAX_AGE_S = b"600"


def parse_origins(value: str | None) -> tuple[str, ...]:
    """A comma list of origins (scheme://host[:port]) or "*"; () for none. ValueError on a malformed one."""
    if not value:
        return ()
    origins = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and "://" not in origin:
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port]) or *")
    return origins


class CorsPolicy:
    """The allowed origins and the headers they get."""

    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any_origin = "*" in origins
        self.origins = frozenset(o.encode() for o in origins if o != "*")

    def __bool__(self) -> bool:
        return self.any_origin or bool(self.origins)

    def allows(self, origin: bytes) -> bool:
        return self.any_origin or origin in self.origins

    def refuses(self, scope: Scope) -> bool:
        """Whether the request comes from a web page of an origin that may not call the API."""
        origin = header(scope, b"origin")
        if origin is None or self.allows(origin):
            return False
        host = header(scope, b"host")
        return host is None or origin.partition(b"://")[2].lower() != host.lower()

    def is_preflight(self, scope: Scope) -> bool:
        return scope["method"] == "OPTIONS" and header(scope, b"access-control-request-method") is not None

    def response_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The headers of any response to this request (none when it has no allowed Origin)."""
        origin = header(scope, b"origin")
        if origin is None or not self.allows(origin):
            return []
        if self.any_origin:
            return [(b"access-control-allow-origin", b"*")]
        return [(b"access-control-allow-origin", origin), (b"vary", b"origin")]

    def preflight(self, scope: Scope) -> tuple[int, list[tuple[bytes, bytes]]]:
        """(status, headers) of the answer to a preflight: 204 with the allowances, or 403."""
        headers = self.response_headers(scope)
        if not headers:
            return 403, []
        requested = header(scope, b"access-control-request-headers")
        return 204, headers + [(b"access-control-allow-methods", ALLOWED_METHODS),
                               (b"access-control-allow-headers", requested or DEFAULT_ALLOWED_HEADERS),
                               (b"access-control-max-age", PREFLIGHT_MAX_AGE_S)]
