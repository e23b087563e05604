"""A raw HTTP/2 server that answers every call with whatever the test scripted, well-formed or not.

The clients' fuzz tests (test_client_fuzz_responses.py) use it to play a broken or hostile server: response
headers with any status and content type, message frames whose prefix lies, bytes that are no message,
trailers with any grpc-status and grpc-message, or no end at all, a reset, a GOAWAY, a closed connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated, DataReceived, StreamEnded
from h2.exceptions import H2Error

Headers = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True, slots=True)
class Reply:
    """One call's answer. `ending`: "trailers" (then `trailers`), "end" (END_STREAM on the last DATA, no
    trailers), "reset" (RST_STREAM), "goaway", "close" (the connection), "hang" (nothing more, ever)."""

    headers: Headers | None  # None: no response headers at all
    data: tuple[bytes, ...]  # the response body's pieces, as drawn (gRPC framing included, or not)
    ending: str
    trailers: Headers = ()
    is_trailers_only: bool = False  # the headers end the stream (a trailers-only response)


class RawServer:
    """Serves on 127.0.0.1 (port in `port`); `reply` is what the next calls get."""

    def __init__(self) -> None:
        self.reply = Reply(headers=None, data=(), ending="close")
        self.port = 0
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        conn = H2Connection(H2Configuration(client_side=False, validate_outbound_headers=False,
                                            normalize_outbound_headers=False))
        conn.initiate_connection()
        try:
            writer.write(conn.data_to_send())
            while data := await reader.read(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, DataReceived):
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, StreamEnded):
                        if not self._answer(conn, event.stream_id):
                            writer.write(conn.data_to_send())
                            return
                    elif isinstance(event, ConnectionTerminated):
                        return
                writer.write(conn.data_to_send())
                await writer.drain()
        except (H2Error, OSError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _answer(self, conn: H2Connection, stream_id: int) -> bool:
        """Writes the reply into `conn`; False: the connection is to be closed."""
        reply = self.reply
        if reply.headers is not None:
            conn.send_headers(stream_id, list(reply.headers), end_stream=reply.is_trailers_only)
            if reply.is_trailers_only:
                return True
            self._send_data(conn, stream_id, reply.data, end_stream=reply.ending == "end")
        if reply.ending == "trailers" and reply.trailers:  # (without headers: trailers only, no :status)
            conn.send_headers(stream_id, list(reply.trailers), end_stream=True)
        elif reply.ending == "trailers" and reply.headers is not None:  # (an empty block cannot be sent)
            conn.send_data(stream_id, b"", end_stream=True)
        elif reply.ending in ("reset", "trailers") or (reply.ending == "end" and reply.headers is None):
            conn.reset_stream(stream_id)
        elif reply.ending == "goaway":
            conn.close_connection()
            return False
        elif reply.ending == "close":
            return False
        return True

    @staticmethod
    def _send_data(conn: H2Connection, stream_id: int, payloads: tuple[bytes, ...], *,
                   end_stream: bool) -> None:
        data = b"".join(payloads)
        # NOTE: within the client's flow-control window (the client's end of it is not what is tested here)
        data = data[:conn.local_flow_control_window(stream_id)]
        size = conn.max_outbound_frame_size
        pieces = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
        for i, piece in enumerate(pieces):
            if piece or (end_stream and i == len(pieces) - 1):
                conn.send_data(stream_id, piece, end_stream=end_stream and i == len(pieces) - 1)


@contextlib.asynccontextmanager
async def raw_server() -> AsyncIterator[RawServer]:
    server = RawServer()
    await server.start()
    try:
        yield server
    finally:
        await server.close()
