"""Length-prefixed pickled messages over a pipe: how rank 0 hands each step to the other ranks.

A follower waits for its next step blocked in read() on its pipe, using no CPU; waiting inside a
collective would busy-poll a core for as long as the server is idle (mx.distributed's ring
backend spins while a collective is pending). The pipe is local and written only by the parent
process, so pickle is safe here.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, BinaryIO

__all__ = ["recv_message", "send_message"]

_HEADER = struct.Struct("<Q")  # payload length in bytes


def send_message(stream: BinaryIO, message: Any) -> None:
    """Write one message and flush (BrokenPipeError when the reader is gone)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def recv_message(stream: BinaryIO) -> Any | None:
    """The next message, or None at end of stream (the writer is gone or closed the pipe)."""
    header = _read_exactly(stream, _HEADER.size)
    if header is None:
        return None
    payload = _read_exactly(stream, _HEADER.unpack(header)[0])
    if payload is None:
        return None
    return pickle.loads(payload)


def _read_exactly(stream: BinaryIO, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
