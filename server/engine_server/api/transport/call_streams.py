"""grpclib's per-call protocol objects (a server stream and its receive buffer), with what most calls never
use made on first use.

grpclib builds, for every call, three asyncio.Events on its protocol Stream (window updates, and a client's
headers and trailers) and a Buffer around an asyncio.Queue (with an Event of its own) and a deque: ~4 us per
call here, before anything is received. A unary-request call (a Generate) receives one DATA frame and the
end of its stream, and the fast path (fast_path.py) takes that from the buffer without ever waiting on
it. `LeanStream` / `LeanBuffer` keep received data in a list until someone reads the buffer the way grpclib
does, and make the Events, the Queue and the deque when they are first asked for: the same objects and
behaviour from then on.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from functools import cached_property, partial
from typing import Any

from grpclib.protocol import AckedData, Buffer, Connection, Stream, UnackedData


class LeanBuffer(Buffer):
    """grpclib's Buffer; received data is kept in `items` until the Queue is first asked for."""

    def __init__(self, ack_callback: Any) -> None:  # NOTE: not Buffer's: its Queue and deque are made later
        self._ack_callback = ack_callback
        self._eof = False
        self._acked_size = 0
        self.items: list[UnackedData] | None = []  # None once the Queue holds them

    @cached_property
    def _unacked(self) -> asyncio.Queue[UnackedData]:  # type: ignore[override]
        queue: asyncio.Queue[UnackedData] = asyncio.Queue()
        items, self.items = self.items, None
        for item in items or ():
            queue.put_nowait(item)
        return queue

    @cached_property
    def _acked(self) -> deque[AckedData]:  # type: ignore[override]
        return deque()

    def add(self, data: bytes, ack_size: int) -> None:
        items = self.items
        if items is None:
            super().add(data, ack_size)
        else:
            items.append(UnackedData(data, len(data), ack_size))

    def eof(self) -> None:
        items = self.items
        if items is None:
            super().eof()
        else:
            items.append(UnackedData(b"", 0, 0))
            self._eof = True

    def take_all(self) -> list[UnackedData]:
        """Everything received and not read (the end marker included), taken out unacknowledged."""
        items = self.items
        if items is not None:
            self.items = []
            return items
        queue = self._unacked
        return [queue.get_nowait() for _ in range(queue.qsize())]

    def unacked_size(self) -> int:
        items = self.items
        if items is None:
            return super().unacked_size()
        self.items = []
        return sum(item.ack_size for item in items)


class LeanStream(Stream):
    """grpclib's server-side protocol Stream with its Events made on first use and a LeanBuffer."""

    def __init__(self, connection: Connection, h2_connection: Any, transport: Any, *, stream_id: int) -> None:
        # NOTE: as Stream.__init__ for a server stream, without its three Events
        self.connection = connection
        self._h2_connection = h2_connection
        self._transport = transport
        self.wrapper = None
        self.headers = None
        self.trailers = None
        self.init_stream(stream_id, connection)

    def init_stream(self, stream_id: int, connection: Connection) -> None:
        # NOTE: as Stream.init_stream, with a LeanBuffer
        self.id = stream_id
        self.buffer = LeanBuffer(partial(connection.ack, stream_id))
        connection.streams_started += 1
        self.created = connection.last_stream_created = time.monotonic()

    @cached_property
    def window_updated(self) -> asyncio.Event:  # type: ignore[override]
        return asyncio.Event()

    @cached_property
    def headers_received(self) -> asyncio.Event:  # type: ignore[override]
        return asyncio.Event()

    @cached_property
    def trailers_received(self) -> asyncio.Event:  # type: ignore[override]
        return asyncio.Event()
