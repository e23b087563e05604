"""The streaming hot path: a Generate response as one hand-built HTTP/2 DATA frame, without grpclib's and h2's
per-message machinery (event dispatch, BytesIO, h2's stream/connection state machines, frame objects); the
response headers and the OK trailers as constant HPACK blocks.

Measured at 256 streams on the simulated engine, `grpclib.Stream.send_message` was ~30% of the frontend's CPU;
the bytes it produces are a 9-byte frame header + the 5-byte gRPC prefix + the message. This writes the same
bytes and keeps h2's books (both flow-control windows) and grpclib's counters as send_message would (the
connection's once per loop tick, see `_SendBooks`). Anything
unusual falls back to `send_message`: headers not sent yet, a SendMessage listener, a stream not in
HALF_CLOSED_REMOTE, a window or frame-size limit, writes paused, an unexpected grpclib/h2 (grpclib is pinned
< 0.5; tests/perf checks this path against the slow one).

Headers and trailers: h2's `send_headers` (HPACK encoding, header validation, frame objects) and grpclib's
around it cost ~10% of the frontend's CPU at 256 streams, for two header blocks that never change. The blocks
below use only the static table and literals "without indexing", so h2's HPACK encoder (whose dynamic table
the client mirrors) is left exactly as it was; the stream's state machine is driven as h2 would drive it.
"""

from __future__ import annotations

import asyncio
import functools
import struct
import weakref
from collections.abc import Callable
from typing import Any

from grpclib.events import SendInitialMetadata, SendMessage, SendTrailingMetadata
from h2.connection import ConnectionState
from h2.stream import StreamClosedBy, StreamState

from engine_server.api.transport.h2_streams import DATA, END_HEADERS, END_STREAM, FRAME_HEADER, HEADERS
from engine_server.api.transport.limits import MESSAGE_PREFIX
from engine_server.api.transport.write_batch import BatchingTransport

_pack_data_header = struct.Struct(">BHBBLBL").pack  # a DATA frame's header, then the gRPC prefix
_MIN_MAX_FRAME_SIZE = 16384  # SETTINGS_MAX_FRAME_SIZE can only be raised from this (RFC 9113 6.5.2)
_HALF_CLOSED_REMOTE = StreamState.HALF_CLOSED_REMOTE  # (an enum member: a module global reads faster)


def _hpack_string(value: bytes) -> bytes:
    assert len(value) < 0x7F  # a 7-bit length prefix, no Huffman coding
    return bytes([len(value)]) + value


@functools.cache
def initial_headers_block(content_type: str) -> bytes:
    """":status: 200" (static entry 8, indexed), content-type (static name 31, literal without indexing)."""
    return b"\x88" + b"\x0f\x10" + _hpack_string(content_type.encode("ascii"))


# "grpc-status: 0": a literal without indexing with a new name.
OK_TRAILERS_BLOCK = b"\x00" + _hpack_string(b"grpc-status") + _hpack_string(b"0")


def mark_headers_sent(machine: Any, *, end_stream: bool) -> bool:
    """h2's stream state machine (HALF_CLOSED_REMOTE, server side) given SEND_HEADERS, then SEND_END_STREAM
    if `end_stream`, by hand; False (nothing changed) where h2 would do more than that.

    NOTE: h2's `process_input` (table lookup, enum hashing, an event object per input) was ~1/3 of writing a
    header block here: response headers, then trailers, are marked sent; the end closes the stream, closed
    by us.
    """
    if machine.state is not _HALF_CLOSED_REMOTE or machine.client is not False or machine.trailers_sent:
        return False
    if machine.headers_sent:
        machine.trailers_sent = True
    else:
        machine.headers_sent = True
    if end_stream:
        machine.stream_closed_by = StreamClosedBy.SEND_END_STREAM
        machine.state = StreamState.CLOSED
    return True


class _SendBooks:
    """A connection's books for the DATA frames FastSender wrote in one loop tick, kept once at its end.

    NOTE: grpclib's send_message keeps per-connection counters and calls `data_send_process` (keepalive:
    the last data time, pings-without-data reset; the guard: frame count and WINDOW_UPDATE credit) for every
    message: ~0.4 us each, ~50 times per request at 256 streams. Here the tick's frames are counted and handed
    over at once (the guard's `data_frames_sent(n)`; `data_send_process` per frame on a connection without
    it) before anything the peer sends next is read: nothing that reads the books runs in between.
    """

    __slots__ = ("_connection", "loop", "num_bytes", "num_frames")

    def __init__(self, connection: Any) -> None:
        # NOTE: weak: the connection keeps its books; both strong, a lost connection and all it held were a
        # reference cycle, which only a full collection frees (issue 37, item 4)
        self._connection: Callable[[], Any] = weakref.ref(connection)
        self.loop = asyncio.get_running_loop()
        self.num_frames = self.num_bytes = 0

    @classmethod
    def of(cls, connection: Any) -> _SendBooks:
        books: _SendBooks | None = getattr(connection, "_engine_send_books", None)
        if books is None:
            books = cls(connection)
            connection._engine_send_books = books
        return books

    def commit(self) -> None:
        num_frames, num_bytes = self.num_frames, self.num_bytes
        self.num_frames = self.num_bytes = 0
        connection = self._connection()
        if connection is None:
            return  # (gone, and its books with it)
        connection.data_sent += num_bytes
        connection.messages_sent += num_frames
        frames_sent = getattr(connection, "data_frames_sent", None)
        if frames_sent is not None:
            frames_sent(num_frames)
        else:
            for _ in range(num_frames):
                connection.data_send_process()
        connection.last_message_sent = connection.last_data_sent  # the time data_send_process took


class FastSender:
    """Per call: `await sender.send(message)` instead of `await stream.send_message(message)`."""

    __slots__ = (
        "_before_end", "_books", "_connection", "_h2", "_h2_stream", "_headers_ok", "_is_closing",
        "_is_write_ready", "_ok", "_proto_stream", "_stream", "_stream_id", "_trailers_ok", "_write",
    )

    def __init__(self, stream: Any, *, before_end: Callable[[], None] | None = None) -> None:
        """`before_end`: called once, before the call's end (the trailers) is written, by either path."""
        self._stream = stream
        self._before_end = before_end
        self._ok = self._headers_ok = self._trailers_ok = False
        try:
            proto_stream = stream._stream
            self._proto_stream = proto_stream
            self._h2 = proto_stream._h2_connection
            transport = proto_stream._transport
            self._connection = proto_stream.connection
            self._stream_id = proto_stream.id
            # NOTE: bound once (a message's checks and write are ~1 us in all; the lookups were a good part)
            self._write = transport.write
            self._is_write_ready = self._connection.write_ready.is_set
            self._is_closing = (transport.inner_is_closing if isinstance(transport, BatchingTransport)
                                else transport.is_closing)
            # NOTE: h2's stream object of this id for the call's life (ids are never reused; a closed stream
            # leaves the table but its state stays CLOSED, which every write below checks)
            self._h2_stream = self._h2.streams.get(proto_stream.id)
            self._books = _SendBooks.of(self._connection)
            listeners = stream._dispatch._listeners
            self._ok = not listeners.get(SendMessage)
            self._headers_ok = self._ok and not listeners.get(SendInitialMetadata)
            self._trailers_ok = self._ok and not listeners.get(SendTrailingMetadata)
        except AttributeError:  # another grpclib: the slow path only
            self._ok = False
        if not self._ok:
            self._h2_stream = None

    async def send(self, message: Any) -> None:
        if not self.try_send(message):
            await self._stream.send_message(message)

    def try_send(self, message: Any) -> bool:
        """Writes the message now if the fast path applies (no await); False: nothing was written, send it
        with `send` (or grpclib's `send_message`) instead."""
        if not self._ok or not self._stream._send_initial_metadata_done:
            return False
        return self.try_send_serialized(message.SerializeToString())

    def try_send_serialized(self, payload: bytes) -> bool:
        """`try_send` for a message already serialized."""
        stream = self._stream
        h2_stream = self._h2_stream  # (as _writable_h2_stream, written out: this runs for every message)
        if (h2_stream is None or not stream._send_initial_metadata_done
                or h2_stream.state_machine.state is not _HALF_CLOSED_REMOTE
                or not self._is_write_ready() or self._is_closing()):
            return False
        size = len(payload) + MESSAGE_PREFIX.size
        h2 = self._h2
        if ((size > _MIN_MAX_FRAME_SIZE and size > h2.max_outbound_frame_size)
                or size > h2_stream.outbound_flow_control_window or size > h2.outbound_flow_control_window):
            return False
        h2_stream.outbound_flow_control_window -= size
        h2.outbound_flow_control_window -= size
        if h2._data_to_send:  # NOTE: frames h2 queued must go first, to keep the order
            self._write(h2.data_to_send())
        self._write(_pack_data_header(size >> 16, size & 0xFFFF, DATA, 0, self._stream_id, 0, len(payload))
                    + payload)
        self._proto_stream.data_sent += size
        stream._send_message_done = True
        stream._messages_sent += 1
        books = self._books
        if not books.num_frames:
            books.loop.call_soon(books.commit)
        books.num_frames += 1
        books.num_bytes += size
        return True

    @property
    def initial_metadata_sent(self) -> bool:
        return bool(self._stream._send_initial_metadata_done)

    async def send_initial_metadata(self) -> None:
        """The response headers (no custom metadata)."""
        if not self.try_send_initial_metadata():
            await self._stream.send_initial_metadata()

    def try_send_initial_metadata(self) -> bool:
        """The response headers now if the fast path applies; False: nothing was written."""
        stream = self._stream
        if not (self._headers_ok and not stream._send_initial_metadata_done
                and self._try_send_headers(initial_headers_block(stream._content_type), end_stream=False)):
            return False
        stream._send_initial_metadata_done = True
        return True

    def try_send_ok_trailers(self) -> bool:
        """Ends the call with status OK if the fast path applies; False: grpclib's `Stream.__aexit__` will.

        NOTE: `before_end` runs first either way: the client may act on the end (open its next stream) the
        moment it reads it, so whatever the call held is given back before the end can leave.
        """
        before_end = self._before_end
        if before_end is not None:
            self._before_end = None
            before_end()
        stream = self._stream
        if not (self._trailers_ok and stream._send_initial_metadata_done
                and not stream._send_trailing_metadata_done
                and self._try_send_headers(OK_TRAILERS_BLOCK, end_stream=True)):
            return False
        stream._send_trailing_metadata_done = True
        return True

    def _try_send_headers(self, block: bytes, *, end_stream: bool) -> bool:
        h2 = self._h2
        h2_stream = self._writable_h2_stream()
        if (h2_stream is None or h2.state_machine.state is not ConnectionState.SERVER_OPEN
                or h2.encoder.header_table.resized  # a pending table-size update must lead the next block
                or len(block) > h2.max_outbound_frame_size):
            return False
        # NOTE: the connection's SEND_HEADERS in SERVER_OPEN changes nothing in h2's state machine
        if not mark_headers_sent(h2_stream.state_machine, end_stream=end_stream):
            return False
        flags = END_HEADERS | END_STREAM if end_stream else END_HEADERS
        size = len(block)
        header = FRAME_HEADER.pack(size >> 16, size & 0xFFFF, HEADERS, flags, self._stream_id)
        self._write_frame(header + block)
        self._connection.headers_send_process()
        return True

    def _writable_h2_stream(self) -> Any:
        """h2's stream if a frame may be written on it now (open towards the client, writes not paused)."""
        h2_stream = self._h2_stream
        if (h2_stream is None or h2_stream.state_machine.state is not _HALF_CLOSED_REMOTE
                or not self._is_write_ready() or self._is_closing()):
            return None
        return h2_stream

    def _write_frame(self, frame: bytes) -> None:
        h2 = self._h2
        if h2._data_to_send:  # NOTE: frames h2 queued must go first, to keep the order
            self._write(h2.data_to_send())
        self._write(frame)
