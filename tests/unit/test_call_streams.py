"""api/transport/call_streams.py: LeanBuffer reads, acknowledges and counts exactly as grpclib's Buffer,
whether its Queue was made before the data arrived or after; LeanStream makes its Events on first use."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from engine_server.api.transport.call_streams import LeanBuffer, LeanStream
from grpclib.protocol import Buffer

FRAMES = [b"\x00\x00\x00\x00\x05hel", b"lo", b"\x00\x00\x00\x00\x02ok"]


async def _read_all(buffer: Any, sizes: list[int]) -> list[bytes]:
    return [await buffer.read(size) for size in sizes]


@pytest.mark.parametrize("queue_first", [False, True])
async def test_a_lean_buffer_reads_as_grpclibs_buffer(queue_first: bool) -> None:
    acks: dict[str, list[int]] = {"grpclib": [], "lean": []}
    buffers: dict[str, Any] = {
        "grpclib": Buffer(acks["grpclib"].append), "lean": LeanBuffer(acks["lean"].append),
    }
    if queue_first:  # someone asked for the Queue before anything arrived (grpclib's own receive path)
        assert buffers["lean"]._unacked.empty()
    for buffer in buffers.values():
        for frame in FRAMES:
            buffer.add(frame, len(frame) + 1)  # (+1: padding counts towards flow control)
        buffer.eof()
    reads = {name: await _read_all(buffer, [5, 5, 5, 2, 0]) for name, buffer in buffers.items()}
    assert reads["lean"] == reads["grpclib"] == [b"\x00\x00\x00\x00\x05", b"hello", b"\x00\x00\x00\x00\x02",
                                                  b"ok", b""]
    assert acks["lean"] == acks["grpclib"]
    assert await buffers["lean"].read(5) == await buffers["grpclib"].read(5) == b""  # at the end


async def test_unacked_size_and_take_all() -> None:
    lean, plain = LeanBuffer(lambda size: None), Buffer(lambda size: None)
    for buffer in (lean, plain):
        buffer.add(b"abc", 4)
        buffer.add(b"de", 2)
        buffer.eof()
    assert lean.unacked_size() == plain.unacked_size() == 6
    assert lean.unacked_size() == 0  # counted once, as grpclib's drains its queue

    other = LeanBuffer(lambda size: None)
    other.add(b"abc", 3)
    other.eof()
    assert [item.data for item in other.take_all()] == [b"abc", b""]
    assert other.take_all() == []
    late = LeanBuffer(lambda size: None)
    late.add(b"x", 1)
    assert late._unacked.qsize() == 1  # the Queue, once made, holds what arrived before
    late.eof()
    assert [item.data for item in late.take_all()] == [b"x", b""]


async def test_a_lean_streams_events_are_made_on_first_use() -> None:
    class _Connection:
        streams_started = 0
        last_stream_created = 0.0

        def ack(self, stream_id: int, size: int) -> None:
            pass

    connection: Any = _Connection()
    stream = LeanStream(connection, None, None, stream_id=7)
    assert stream.id == 7
    assert connection.streams_started == 1
    assert "window_updated" not in vars(stream)
    event = stream.window_updated
    assert isinstance(event, asyncio.Event)
    assert stream.window_updated is event
    assert isinstance(stream.buffer, LeanBuffer)
    assert (stream.headers, stream.trailers, stream.wrapper) == (None, None, None)
