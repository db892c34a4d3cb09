"""Per-request async token streams.

The engine pushes deltas into an `OutputChannel`; the consumer iterates the `RequestStream` that
wraps it.

    engine loop --put(delta)--> OutputChannel  <--get()-- RequestStream <-- async for / aclose()

`async for` iterates a fresh async generator (`__aiter__`), which only the loop holds: breaking out
of the loop, or an exception in its body, releases it at once and its `finally` aborts the request,
whether or not the consumer still holds the stream object. An abort names the stream's own channel,
so a stale stream never ends a newer request that reuses its id.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Callable

from metrale.errors import RequestFailedError
from metrale.outputs import RequestOutput



async def _deltas_until_closed(stream: RequestStream | GroupStream) -> AsyncIterator[RequestOutput]:
    """What `async for` iterates over a stream: ending the loop early in any way (break, an
    exception, the task cancelled) closes the stream, which aborts its request(s)."""
    try:
        while True:
            try:
                output = await stream.__anext__()
            except StopAsyncIteration:
                return
            yield output
    finally:
        stream._close()


def _failure(channel: OutputChannel) -> RequestFailedError:
    """What a stream raises after a failed request's last delta, chained to the original error."""
    cause = channel.error
    kind = getattr(cause, "kind", None) or type(cause).__name__  # a RowFailedError names the original type
    failure = RequestFailedError(channel.request_id, f"{kind}: {cause}")
    failure.__cause__ = cause
    return failure

class OutputChannel:
    """The engine's side of one stream: holds at most one pending delta, merging later ones into it.

    A slow consumer therefore costs O(1) objects and never stalls the engine loop.
    """

    __slots__ = ("request_id", "_pending", "_ready", "error", "notify")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()
        self.error: BaseException | None = None
        self.notify: asyncio.Event | None = None  # also set on put (a GroupStream waiting on several channels)

    def put(self, output: RequestOutput, error: BaseException | None = None) -> None:
        """Queue a delta (merged into any unread one). Called on the event-loop thread only."""
        if error is not None:
            self.error = error
        if self._pending is None:
            self._pending = output
        else:
            self._pending.merge(output)
        self._ready.set()
        if self.notify is not None:
            self.notify.set()

    def take(self) -> RequestOutput | None:
        """The pending delta without waiting, or None."""
        output, self._pending = self._pending, None
        return output

    async def get(self) -> RequestOutput:
        """The next (possibly merged) delta; waits until there is one."""
        while self._pending is None:
            self._ready.clear()
            await self._ready.wait()
        output, self._pending = self._pending, None
        return output


class RequestStream:
    """Async iterator of `RequestOutput` deltas for one request; also an async context manager.

    Ending it early in any way (`aclose()`, leaving `async with`, breaking out of `async for`, an
    exception in the loop's body, cancelling the consuming task) aborts the request; its KV blocks
    are freed at the next step boundary. A request that fails yields its last delta (finish_reason
    "error"), then raises `RequestFailedError` from the original exception. `abort` is called with
    the request id (the engine binds it to this stream's channel).
    """

    def __init__(self, channel: OutputChannel, abort: Callable[[str], object]) -> None:
        self._channel = channel
        self._abort = abort
        self._finished = False  # the final delta was read, or the stream was closed
        self._raise_next: BaseException | None = None

    @property
    def request_id(self) -> str:
        return self._channel.request_id

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return _deltas_until_closed(self)

    async def __anext__(self) -> RequestOutput:
        if self._raise_next is not None:
            error, self._raise_next = self._raise_next, None
            raise error
        if self._finished:
            raise StopAsyncIteration
        try:
            output = await self._channel.get()
        except asyncio.CancelledError:
            self._close()
            raise
        if output.finish_reason is not None:
            self._finished = True
            if output.finish_reason == "error":
                self._raise_next = _failure(self._channel)
        return output

    async def aclose(self) -> None:
        """End the stream now; the request is aborted unless it already finished."""
        self._close()

    def _close(self) -> None:
        if not self._finished:
            self._finished = True
            self._abort(self.request_id)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._close()

    def __del__(self) -> None:
        self._close()  # dropped without reaching its end (iterated by hand and never closed): abort


class GroupStream:
    """The deltas of the n sequences of one request (parallel sampling, SamplingParams.n > 1), as one
    async iterator: each delta's `index` names its sequence (0..n-1); it ends when every sequence
    has ended. Same contract as RequestStream: ending it early aborts every sequence; a sequence that
    fails (the engine then fails its siblings too) yields its last delta and then raises
    RequestFailedError. `request_id` is sequence 0's, the id `engine.abort` takes for the group.
    """

    def __init__(self, channels: list[OutputChannel], abort: Callable[[OutputChannel], object]) -> None:
        self._channels = channels
        self._abort = abort  # aborts one sequence, by its channel
        self._ready = asyncio.Event()
        for channel in channels:
            channel.notify = self._ready
        self._open = list(range(len(channels)))  # sequences whose final delta has not been read
        self._raise_next: BaseException | None = None
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._channels[0].request_id

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return _deltas_until_closed(self)

    async def __anext__(self) -> RequestOutput:
        if self._raise_next is not None:
            error, self._raise_next = self._raise_next, None
            raise error
        if self._closed or not self._open:
            raise StopAsyncIteration
        try:
            while True:
                for index in self._open:
                    output = self._channels[index].take()
                    if output is not None:
                        return self._emit(index, output)
                self._ready.clear()
                await self._ready.wait()
        except asyncio.CancelledError:
            self._close()
            raise

    def _emit(self, index: int, output: RequestOutput) -> RequestOutput:
        output.index = index
        if output.finish_reason is not None:
            self._open.remove(index)
            if output.finish_reason == "error":
                self._raise_next = _failure(self._channels[index])
                self._close()  # its siblings end too (the engine fails them; this aborts any it did not)
        return output

    async def aclose(self) -> None:
        """End every sequence now; those not finished are aborted."""
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            for index in self._open:
                self._abort(self._channels[index])

    async def __aenter__(self) -> "GroupStream":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._close()

    def __del__(self) -> None:
        if not self._closed and self._open:
            self._close()
