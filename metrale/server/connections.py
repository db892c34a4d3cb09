"""uvicorn's HTTP/1.1 protocol with a deadline on request headers.

uvicorn's keep-alive timer is cancelled by any byte that arrives, and nothing bounds how long a
request's headers may take: a client that trickles them (slowloris) holds a connection forever.
Here every request's line and headers must be complete within `header_timeout_s` of the connection
opening or of the previous response ending; otherwise the connection is closed. (Bodies are bounded
by ServerApp's body timeout.)
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def deadline_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol subclass closing connections whose request headers miss the deadline."""

    class HeaderDeadlineProtocol(H11Protocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers on a kept-alive connection

        def handle_events(self) -> None:
            super().handle_events()
            if self._header_deadline is not None and self.conn.their_state is not h11.IDLE:
                self._disarm()  # the request line and headers are in

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_deadline = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_too_slow(self) -> None:
            self._header_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.info("closing a connection whose request headers took over %.0f s", header_timeout_s)
                self.transport.close()

    return HeaderDeadlineProtocol
