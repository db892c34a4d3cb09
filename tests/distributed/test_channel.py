"""metrale/distributed/channel.py and the launcher's ports: framing over a real pipe; the config's size."""

from __future__ import annotations

import os

import pytest

from metrale.distributed.channel import recv_message, send_message
from metrale.distributed.launcher import free_ports
from metrale.engine.step import ForwardInput

pytestmark = pytest.mark.distributed


def test_messages_cross_a_pipe_in_order_and_end_at_eof():
    read_fd, write_fd = os.pipe()
    forward = ForwardInput((1, 2, 3), (3,), (3,), ((0,),), 4, ((1, 2),))
    with os.fdopen(write_fd, "wb") as writer:
        send_message(writer, forward)
        send_message(writer, {"big": b"x" * 20_000})  # both fit the 64 KiB a pipe buffers: no reader needed yet
    with os.fdopen(read_fd, "rb") as reader:
        assert recv_message(reader) == forward
        assert recv_message(reader) == {"big": b"x" * 20_000}
        assert recv_message(reader) is None


def test_a_message_cut_short_reads_as_the_end():
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "wb") as writer:
        writer.write((50).to_bytes(8, "little") + b"short")
    with os.fdopen(read_fd, "rb") as reader:
        assert recv_message(reader) is None


def test_free_ports_are_distinct():
    ports = free_ports(4)
    assert len(set(ports)) == 4 and all(p > 0 for p in ports)


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "2"])
def test_engine_config_refuses_a_bad_tensor_parallel_size(size):
    from metrale import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        EngineConfig(tensor_parallel_size=size)
    assert EngineConfig(tensor_parallel_size=2).tensor_parallel_size == 2
