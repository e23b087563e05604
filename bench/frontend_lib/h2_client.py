"""A minimal gRPC-over-HTTP/2 client for the load generator: unary-request, streamed-response calls only.

Why not grpclib: its per-message client path (h2's state machines and frame objects, event dispatch) made the
load generator the busiest process of a 256-stream run. Here a DATA frame costs a header unpack, a slice and
`FromString` (upb); stream windows are opened wide once (SETTINGS) and the connection window is topped up with
one WINDOW_UPDATE per read. HPACK (the `hpack` package, which h2 uses) runs on HEADERS frames only.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

from hpack import Decoder, Encoder

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_FRAME = struct.Struct(">BHBBL")  # length (8 + 16 bits), type, flags, stream id
_DATA, _HEADERS, _RST, _SETTINGS, _PING, _GOAWAY, _CONTINUATION = 0, 1, 3, 4, 6, 7, 9
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
_MAX_WINDOW = 2**31 - 1
_TOP_UP = 1 << 24  # connection-window bytes consumed before one WINDOW_UPDATE


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    size = len(payload)
    return _FRAME.pack(size >> 16, size & 0xFFFF, kind, flags, stream_id) + payload


class GrpcError(RuntimeError):
    pass


class _Call:
    __slots__ = ("buffer", "done", "on_message", "status")

    def __init__(self, on_message: Callable[[bytes], None], done: asyncio.Future[None]) -> None:
        self.buffer = b""
        self.on_message = on_message
        self.done = done
        self.status: str | None = None


class H2GrpcConnection(asyncio.Protocol):
    def __init__(self, authority: str) -> None:
        self._authority = authority
        self._encoder, self._decoder = Encoder(), Decoder()
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._calls: dict[int, _Call] = {}
        self._next_id = 1
        self._consumed = 0
        self._header_block: tuple[int, int, bytes] | None = None  # stream, flags, fragment (CONTINUATION)
        self._lost: BaseException | None = None

    @classmethod
    async def connect(cls, host: str, port: int) -> H2GrpcConnection:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(lambda: cls(f"{host}:{port}"), host, port)
        return protocol

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        settings = struct.pack(">HL", 0x4, _MAX_WINDOW) + struct.pack(">HL", 0x2, 0)  # window; no push
        transport.write(_PREFACE + _frame(_SETTINGS, 0, 0, settings)
                        + _frame(8, 0, 0, struct.pack(">L", _MAX_WINDOW - 65535)))

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = exc or ConnectionError("connection closed")
        for call in self._calls.values():
            if not call.done.done():
                call.done.set_exception(self._lost)
        self._calls.clear()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def call(self, path: str, request: bytes, on_message: Callable[[bytes], None]) -> asyncio.Future[None]:
        """Starts a call; `on_message(bytes)` per response message; the future ends with the status."""
        assert self._transport is not None
        if self._lost is not None:
            raise self._lost
        stream_id, self._next_id = self._next_id, self._next_id + 2
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._calls[stream_id] = _Call(on_message, done)
        block = self._encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", self._authority),
            ("content-type", "application/grpc"), ("te", "trailers"),
        ])
        body = struct.pack(">BL", 0, len(request)) + request
        self._transport.write(_frame(_HEADERS, _END_HEADERS, stream_id, block)
                              + _frame(_DATA, _END_STREAM, stream_id, body))
        return done

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        offset, end = 0, len(buffer)
        replies: list[bytes] = []
        while end - offset >= 9:
            high, low, kind, flags, stream_id = _FRAME.unpack_from(buffer, offset)
            size = (high << 16) | low
            if end - offset - 9 < size:
                break
            payload = buffer[offset + 9:offset + 9 + size]
            offset += 9 + size
            stream_id &= 0x7FFFFFFF
            if kind == _DATA:
                self._consumed += size
                if flags & _PADDED:
                    payload = payload[1:len(payload) - payload[0]]
                self._on_data(stream_id, payload, flags)
            elif kind in (_HEADERS, _CONTINUATION):
                self._on_headers(kind, stream_id, flags, payload)
            elif kind == _SETTINGS and not flags & _ACK:
                replies.append(_frame(_SETTINGS, _ACK, 0, b""))
            elif kind == _PING and not flags & _ACK:
                replies.append(_frame(_PING, _ACK, 0, payload))
            elif kind == _RST:
                self._finish(stream_id, GrpcError(f"stream {stream_id} reset: {payload.hex()}"))
            elif kind == _GOAWAY:
                self._lost = GrpcError(f"GOAWAY {payload[8:]!r}")
        self._buffer = buffer[offset:]
        if self._consumed >= _TOP_UP:
            replies.append(_frame(8, 0, 0, struct.pack(">L", self._consumed)))
            self._consumed = 0
        if replies and self._transport is not None:
            self._transport.write(b"".join(replies))

    def _on_data(self, stream_id: int, payload: bytes, flags: int) -> None:
        call = self._calls.get(stream_id)
        if call is None:
            return
        buffer = call.buffer + payload if call.buffer else payload
        offset, end = 0, len(buffer)
        while end - offset >= 5:
            size = int.from_bytes(buffer[offset + 1:offset + 5], "big")
            if end - offset - 5 < size:
                break
            call.on_message(buffer[offset + 5:offset + 5 + size])
            offset += 5 + size
        call.buffer = buffer[offset:]
        if flags & _END_STREAM:
            self._finish(stream_id, GrpcError("stream ended without trailers"))

    def _on_headers(self, kind: int, stream_id: int, flags: int, payload: bytes) -> None:
        if kind == _HEADERS:
            if flags & _PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & _PRIORITY:
                payload = payload[5:]
            self._header_block = (stream_id, flags, payload)
        elif self._header_block is not None:
            first_id, first_flags, fragment = self._header_block
            self._header_block = (first_id, first_flags | (flags & _END_HEADERS), fragment + payload)
        block = self._header_block
        if block is None or not block[1] & _END_HEADERS:
            return
        self._header_block = None
        stream_id, flags, fragment = block
        headers: dict[Any, Any] = dict(self._decoder.decode(fragment))  # NOTE: HPACK state is shared
        call = self._calls.get(stream_id)
        if call is not None and "grpc-status" in headers:
            call.status = str(headers["grpc-status"])
        if flags & _END_STREAM:
            error = None if call is not None and call.status == "0" else GrpcError(f"grpc status {headers}")
            self._finish(stream_id, error)

    def _finish(self, stream_id: int, error: BaseException | None) -> None:
        call = self._calls.pop(stream_id, None)
        if call is None or call.done.done():
            return
        if error is None:
            call.done.set_result(None)
        else:
            call.done.set_exception(error)
