"""The streaming hot path: a Generate response as one hand-built HTTP/2 DATA frame, without grpclib's and h2's
per-message machinery (event dispatch, BytesIO, h2's stream/connection state machines, frame objects).

Measured at 256 streams on the simulated engine, `grpclib.Stream.send_message` was ~30% of the frontend's CPU;
the bytes it produces are a 9-byte frame header + the 5-byte gRPC prefix + the message. This writes the same
bytes and keeps h2's books (both flow-control windows) and grpclib's counters as send_message would. Anything
unusual falls back to `send_message`: headers not sent yet, a SendMessage listener, a stream not in
HALF_CLOSED_REMOTE, a window or frame-size limit, writes paused, an unexpected grpclib/h2 (grpclib is pinned
< 0.5; tests/perf checks this path against the slow one).
"""

from __future__ import annotations

import struct
import time
from typing import Any

from grpclib.events import SendMessage
from h2.stream import StreamState

_FRAME = struct.Struct(">BHBBL")  # 24-bit length (as 8 + 16 bits), type, flags, stream id
_PREFIX = struct.Struct(">BL")  # gRPC: compressed flag, message length
_DATA = 0x0


class FastSender:
    """Per call: `await sender.send(message)` instead of `await stream.send_message(message)`."""

    __slots__ = ("_connection", "_h2", "_ok", "_proto_stream", "_stream", "_transport")

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._ok = False
        try:
            proto_stream = stream._stream
            self._proto_stream = proto_stream
            self._h2 = proto_stream._h2_connection
            self._transport = proto_stream._transport
            self._connection = proto_stream.connection
            self._ok = not stream._dispatch._listeners.get(SendMessage)
        except AttributeError:  # another grpclib: the slow path only
            self._ok = False

    async def send(self, message: Any) -> None:
        if not self.try_send(message):
            await self._stream.send_message(message)

    def try_send(self, message: Any) -> bool:
        """Writes the message now if the fast path applies (no await); False: nothing was written, send it
        with `send` (or grpclib's `send_message`) instead."""
        stream = self._stream
        if not self._ok or not stream._send_initial_metadata_done:
            return False
        payload = message.SerializeToString()
        size = len(payload) + _PREFIX.size
        h2 = self._h2
        proto_stream = self._proto_stream
        h2_stream = h2.streams.get(proto_stream.id)
        connection = self._connection
        if (h2_stream is None or h2_stream.state_machine.state is not StreamState.HALF_CLOSED_REMOTE
                or size > h2.max_outbound_frame_size or size > h2_stream.outbound_flow_control_window
                or size > h2.outbound_flow_control_window or not connection.write_ready.is_set()
                or self._transport.is_closing()):
            return False
        pending = h2.data_to_send()  # NOTE: frames h2 queued must go first, to keep the order
        if pending:
            self._transport.write(pending)
        h2_stream.outbound_flow_control_window -= size
        h2.outbound_flow_control_window -= size
        self._transport.write(
            _FRAME.pack(size >> 16, size & 0xFFFF, _DATA, 0, proto_stream.id) + _PREFIX.pack(0, len(payload))
            + payload
        )
        proto_stream.data_sent += size
        connection.data_sent += size
        connection.data_send_process()
        stream._send_message_done = True
        stream._messages_sent += 1
        connection.messages_sent += 1
        connection.last_message_sent = time.monotonic()
        return True
