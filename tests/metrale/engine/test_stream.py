"""RequestStream and OutputChannel: merging for slow consumers, every way of ending early aborts."""

from __future__ import annotations

import asyncio

import pytest

from metrale.engine.stream import OutputChannel, RequestStream
from metrale.errors import RequestFailedError
from metrale.outputs import RequestOutput

pytestmark = pytest.mark.timeout(10)


def delta(ids, text, finish=None):
    return RequestOutput(request_id="r", token_ids=list(ids), text=text, finish_reason=finish,
                         num_output_tokens=len(ids))


def make():
    aborted = []
    channel = OutputChannel("r")
    return channel, RequestStream(channel, aborted.append), aborted


async def test_unread_deltas_merge_into_one():
    channel, stream, aborted = make()
    channel.put(delta([1], "a"))
    channel.put(delta([2], "b"))
    channel.put(delta([3], "c", "length"))
    outs = [out async for out in stream]
    assert len(outs) == 1 and outs[0].token_ids == [1, 2, 3] and outs[0].text == "abc"
    assert outs[0].finish_reason == "length" and aborted == []


async def test_error_delta_then_raises():
    channel, stream, _ = make()
    channel.put(delta([], "", "error"), error=ValueError("bad row"))
    out = await stream.__anext__()
    assert out.finish_reason == "error"
    with pytest.raises(RequestFailedError, match="bad row"):
        await stream.__anext__()


@pytest.mark.parametrize("how", ["aclose", "context", "cancel"])
async def test_ending_early_aborts_once(how):
    channel, stream, aborted = make()
    channel.put(delta([1], "a"))
    if how == "aclose":
        await stream.__anext__()
        await stream.aclose()
    elif how == "context":
        async with stream:
            await stream.__anext__()
    else:
        task = asyncio.create_task(stream.__anext__())
        await task
        waiting = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    await stream.aclose()  # a second close changes nothing
    assert aborted == ["r"]


async def test_finished_stream_does_not_abort():
    channel, stream, aborted = make()
    channel.put(delta([1], "a", "stop"))
    _ = [out async for out in stream]
    await stream.aclose()
    assert aborted == []
