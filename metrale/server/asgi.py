"""The few ASGI primitives the server needs: bounded body reads, JSON/SSE responses, disconnects.

    body = await read_body(scope, receive, limit)        413 past the limit, before reading it all
    await send_json(send, 200, {...})
    sse = SSEResponse(send); await sse.start(); await sse.event({...}); await sse.done()
    await run_until_disconnect(handler(), receive)      a client that goes away cancels the handler

After the body is read, nothing else may call `receive` while `run_until_disconnect` watches it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Coroutine

import msgspec

from metrale.server.errors import APIError

Scope = dict[str, Any]
Message = dict[str, Any]
logger = logging.getLogger(__name__)
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no")]
_encode = msgspec.json.Encoder().encode


class ClientDisconnected(Exception):
    """The client went away before its request body arrived."""


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a request header (name in lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


MAX_REQUEST_ID_CHARS = 128
# Printable ASCII without spaces (no forged log lines): X-Request-Id and the body's request_id.
# "(?!\\n)": Python's $ also matches before a final newline.
REQUEST_ID_PATTERN = "^[!-~]+$(?!\\n)"


def client_request_id(scope: Scope) -> str | None:
    """The client's X-Request-Id (printable ASCII, at most 128 characters), or None; 400 if malformed."""
    value = header(scope, b"x-request-id")
    if value is None:
        return None
    if not value or len(value) > MAX_REQUEST_ID_CHARS or not all(0x21 <= b < 0x7F for b in value):
        raise APIError(400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters "
                       "without spaces", param="x-request-id", reject_reason="invalid_request")
    return value.decode()


def require_json(scope: Scope) -> None:
    """415 unless the body is declared JSON (application/json, any +json type) or not declared at all.

    text/plain, form and multipart bodies are what a web page may POST without a CORS preflight: they are
    never parsed as JSON."""
    declared = header(scope, b"content-type")
    if declared is None:
        return
    media_type = declared.partition(b";")[0].strip().lower()
    if media_type != b"application/json" and not (media_type.startswith(b"application/")
                                                   and media_type.endswith(b"+json")):
        raise APIError(415, f"Content-Type must be application/json, got {declared[:60].decode('latin-1')!r}",
                       param="content-type", code="unsupported_media_type", reject_reason="invalid_request")


async def read_body(scope: Scope, receive: Receive, limit: int, timeout_s: float | None = None) -> bytes:
    """The whole request body; APIError 413 as soon as it is known to exceed `limit` bytes, 408 when
    it has not all arrived after `timeout_s` (a client that trickles a body holds no slot forever)."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            message = await asyncio.wait_for(receive(), None if deadline is None else
                                             max(0.0, deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            raise APIError(408, f"request body not received within {timeout_s:g} s", code="request_timeout",
                           reject_reason="invalid_request") from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large",
                    reject_reason="invalid_request")


async def send_bytes(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """A complete response with a body."""
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, payload: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A JSON response."""
    await send_bytes(send, status, _encode(payload), _JSON + (headers or []))


async def send_error(send: Send, error: APIError) -> None:
    """An OpenAI error response."""
    await send_json(send, error.status, error.body(), error.headers)


class SSEResponse:
    """A `text/event-stream` response: `data: <json>\\n\\n` events, then `data: [DONE]\\n\\n`."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def start(self) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": _SSE})
        self.started = True

    async def event(self, payload: Any) -> None:
        await self._send({"type": "http.response.body", "body": b"data: " + _encode(payload) + b"\n\n",
                          "more_body": True})

    async def done(self) -> None:
        await self._send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def named_event(self, name: str, payload: Any) -> None:
        """`event: <name>` then the data line (the Responses API's events)."""
        await self._send({"type": "http.response.body", "more_body": True,
                          "body": b"event: " + name.encode() + b"\ndata: " + _encode(payload) + b"\n\n"})

    async def end(self) -> None:
        """End the stream without a [DONE] event."""
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


async def run_until_disconnect(handler: Coroutine[Any, Any, None], receive: Receive) -> bool:
    """Run `handler` until it finishes or the client disconnects, whichever is first.

    On a disconnect the handler task is cancelled (its `finally` blocks abort the engine request)
    and awaited. Returns True if the client disconnected. The handler's own errors propagate.
    """
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also reached when this coroutine is cancelled (server shutdown)
        disconnected = watcher.done() and not task.done()
        for pending in (task, watcher):
            pending.cancel()
        results = await asyncio.gather(task, watcher, return_exceptions=True)
    if disconnected:
        if isinstance(results[1], BaseException):
            raise results[1]  # receive() itself failed: not a disconnect
        if isinstance(results[0], Exception):
            logger.error("request handler failed while cancelling after a disconnect",
                         exc_info=results[0])
        return True
    if isinstance(results[0], BaseException):
        raise results[0]
    return False


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
