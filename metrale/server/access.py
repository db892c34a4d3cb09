"""Who may call the server, checked before any route runs.

    refusal(scope)        403 for a Host it does not answer (hosts.py: DNS rebinding) or an Origin that may
                          not call it (cors.py: a page's fetch or text/plain form); before the body is read
    authenticate(scope)   401 unless `Authorization: Bearer <key>` (scheme in any case, RFC 7235) or
                          `x-api-key: <key>` (Anthropic's clients) when a key is set; /health and /metrics
                          stay open for probes and scrapers
    method_not_allowed    the 405 of a route, with the Allow header RFC 9110 asks for
"""

from __future__ import annotations

import hmac
import re

from metrale.server.asgi import Scope, header
from metrale.server.cors import CorsPolicy
from metrale.server.errors import APIError
from metrale.server.hosts import HostPolicy

OPEN_PATHS = ("/health", "/metrics")  # answered without the API key
_BEARER = re.compile(rb"bearer +(\S+) *", re.IGNORECASE)


class AccessControl:
    """The API key, the allowed origins and the answered hosts of one server."""

    def __init__(self, api_key: str | None, cors: CorsPolicy, hosts: HostPolicy) -> None:
        self._api_key = api_key.encode() if api_key else None
        self.cors = cors
        self.hosts = hosts

    @property
    def needs_key(self) -> bool:
        return self._api_key is not None

    def refusal(self, scope: Scope) -> APIError | None:
        """A 403 for a Host this server does not answer or an Origin that may not call it; else None."""
        if not self.hosts.allows(header(scope, b"host")):
            return APIError(403, "this server does not answer requests for this Host (see --allowed-hosts)",
                            param="host", code="host_not_allowed")
        if self.cors.refuses(scope):
            return APIError(403, "requests from this Origin are not allowed (see --allowed-origins)",
                            param="origin", code="origin_not_allowed")
        return None

    def authenticate(self, scope: Scope) -> None:
        """Raise a 401 unless the route is open or the request carries the key."""
        if self._api_key is None or scope["path"] in OPEN_PATHS:
            return
        for key, value in scope["headers"]:
            token = _BEARER.fullmatch(value) if key == b"authorization" else None
            if token is not None and hmac.compare_digest(token.group(1), self._api_key):
                return
            if key == b"x-api-key" and hmac.compare_digest(value, self._api_key):  # Anthropic's clients
                return
        raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                       code="invalid_api_key")


class MethodNotAllowed(APIError):
    """A 405 whose response names the route's method in an Allow header."""

    def __init__(self, path: str, method: str, allowed: str) -> None:
        super().__init__(405, f"{path} accepts {allowed}, not {method}", code="method_not_allowed")
        self.allowed = allowed

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers, (b"allow", self.allowed.encode())]
