"""A raw HTTP/2 client (the h2 state machine over asyncio streams) to send what real clients never would."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable
from ssl import SSLContext
from typing import cast

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    Event,
    PingAckReceived,
    PingReceived,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from h2.exceptions import ProtocolError
from sec_fakes import WAIT_S


def text_headers(event: ResponseReceived | TrailersReceived) -> list[tuple[str, str]]:
    """A received event's headers: text, as RawH2's connection decodes them (header_encoding="utf-8"), though
    h2 types them as bytes."""
    return cast("list[tuple[str, str]]", event.headers)


def grpc_frame(message: bytes) -> bytes:
    return struct.pack(">?I", False, len(message)) + message


def grpc_headers(
    port: int, path: str, *, scheme: str = "http", metadata: tuple[tuple[str, str], ...] = ()
) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", scheme),
        (":path", path),
        (":authority", f"127.0.0.1:{port}"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *metadata,
    ]


class RawH2:
    """Writes frames as the test dictates; a reader task records the server's events."""

    def __init__(
        self,
        port: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        is_tls: bool = False,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.port = port
        self._scheme = "https" if is_tls else "http"
        self._metadata = metadata
        self.conn = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        self._reader = reader
        self._writer = writer
        self.events: list[Event] = []
        self.goaway: ConnectionTerminated | None = None
        self.num_ping_acks = 0
        self.num_pings = 0  # PINGs the server sent (keepalive)
        self.is_mute = False  # True: answer nothing, not even PINGs (a peer that vanished without a FIN)
        self.num_bytes_received = 0
        self.closed = asyncio.Event()  # EOF, reset or an h2 error on the way in
        self._changed = asyncio.Condition()
        self._read_task: asyncio.Task[None] | None = None

    @property
    def is_closed(self) -> bool:
        return self.closed.is_set() or self.goaway is not None

    async def _read_loop(self) -> None:
        try:
            while data := await self._reader.read(1 << 16):
                self.num_bytes_received += len(data)
                events = self.conn.receive_data(data)
                for event in events:
                    if isinstance(event, PingAckReceived):
                        self.num_ping_acks += 1
                    elif isinstance(event, PingReceived):
                        self.num_pings += 1
                    elif isinstance(event, ConnectionTerminated):
                        self.goaway = event
                self.events.extend(events)
                if not self.is_closed and not self.is_mute:
                    self._writer.write(self.conn.data_to_send())  # SETTINGS and PING ACKs
                async with self._changed:
                    self._changed.notify_all()
        except (ConnectionError, ProtocolError):
            pass
        finally:
            self.closed.set()
            async with self._changed:
                self._changed.notify_all()

    async def flush(self) -> None:
        """Write what the h2 state machine queued; a server that hung up is not an error here."""
        data = self.conn.data_to_send()
        if self.closed.is_set():
            return
        try:
            self._writer.write(data)
            await asyncio.wait_for(self._writer.drain(), WAIT_S)
        except ConnectionError:
            self.closed.set()

    async def write_raw(self, data: bytes) -> None:
        self.conn.data_to_send()  # keep the state machine's queue empty
        try:
            self._writer.write(data)
            await asyncio.wait_for(self._writer.drain(), WAIT_S)
        except ConnectionError:
            self.closed.set()

    async def wait_closed(self) -> None:
        await asyncio.wait_for(self.closed.wait(), WAIT_S)

    def start_call(self, path: str, message: bytes, *, reset: bool = False, end_stream: bool = True) -> int:
        """Queue a unary call (HEADERS + DATA); with reset, cancel it at once (rapid reset); without
        end_stream, the stream stays open (counted against the server's limit) until `conn.end_stream`."""
        stream_id = self.conn.get_next_available_stream_id()
        headers = grpc_headers(self.port, path, scheme=self._scheme, metadata=self._metadata)
        self.conn.send_headers(stream_id, headers)
        self.conn.send_data(stream_id, grpc_frame(message), end_stream=end_stream)
        if reset:
            self.conn.reset_stream(stream_id, error_code=ErrorCodes.CANCEL)
        return stream_id

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT_S), self._changed:
            await self._changed.wait_for(predicate)

    async def wait_stream_done(self, stream_id: int) -> None:
        def is_done() -> bool:
            return self.is_closed or any(
                isinstance(e, StreamEnded | StreamReset) and e.stream_id == stream_id for e in self.events
            )

        async with asyncio.timeout(WAIT_S), self._changed:
            await self._changed.wait_for(is_done)


@contextlib.asynccontextmanager
async def raw_h2(
    port: int, *, ssl: SSLContext | None = None, metadata: tuple[tuple[str, str], ...] = (),
    with_preface: Callable[[RawH2], object] | None = None,
) -> AsyncIterator[RawH2]:
    """A raw connection; `metadata` goes on every call (e.g. the API key). `with_preface(raw)` queues frames
    that leave with the preface, before anything from the server was read (its SETTINGS bind the client's h2
    only once read: e.g. more streams than the server allows)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=ssl), WAIT_S)
    raw = RawH2(port, reader, writer, is_tls=ssl is not None, metadata=metadata)
    raw.conn.initiate_connection()
    if with_preface is not None:
        with_preface(raw)
    raw._read_task = asyncio.get_running_loop().create_task(raw._read_loop())
    try:
        await raw.flush()
        yield raw
    finally:
        writer.close()
        raw._read_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await raw._read_task
