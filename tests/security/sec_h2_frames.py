"""HTTP/2 by hand for the fuzz tests: frames built with struct (any length, type, flags or stream id), a
reader of what the server sends back, and plain h2 as the reference of which byte streams are connection
errors."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from h2.config import H2Configuration
from h2.connection import ConnectionState, H2Connection
from h2.events import ConnectionTerminated, Event, RemoteSettingsChanged, StreamEnded, StreamReset
from h2.exceptions import FlowControlError, ProtocolError, TooManyStreamsError
from h2.settings import SettingCodes
from hpack import Decoder
from hpack.exceptions import HPACKError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types (RFC 9113 6) and flags
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
MAX_FRAME_SIZE = 16384  # the server's SETTINGS_MAX_FRAME_SIZE (h2's default; the server never raises it)
DEFAULT_WINDOW = 65535


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"", *, length: int | None = None) -> bytes:
    """One frame; `length` (24 bits) overrides the payload's, to lie about it."""
    size = len(payload) if length is None else length
    return struct.pack(">I", size)[1:] + struct.pack(">BBL", kind, flags, stream_id & 0xFFFFFFFF) + payload


class ServerFrames:
    """Reads one connection's frames from the server: which streams it ended or reset, PING ACKs, EOF; every
    header block is HPACK-decoded, as a client must (a block that fails is a server bug)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self.ended_ids: set[int] = set()  # END_STREAM or RST_STREAM from the server
        self.ping_acks: set[bytes] = set()
        self.hpack_errors: list[str] = []
        self.is_eof = False
        self._decoder = Decoder()
        # NOTE: lenient: the client may advertise any SETTINGS_HEADER_TABLE_SIZE; the server must stay within.
        self._decoder.max_allowed_table_size = 1 << 32
        self._block = b""
        self._changed = asyncio.Condition()

    async def run(self) -> None:
        buffer = b""
        try:
            while data := await self._reader.read(1 << 16):
                buffer = self._parse(buffer + data)
                async with self._changed:
                    self._changed.notify_all()
        except ConnectionError:
            pass
        finally:
            self.is_eof = True
            async with self._changed:
                self._changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Whether `predicate` (or EOF) came true within the timeout."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(lambda: self.is_eof or predicate())
        return self.is_eof or predicate()

    def _parse(self, buffer: bytes) -> bytes:
        while len(buffer) >= 9:
            size = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + size:
                break
            kind, flags, stream_id = struct.unpack_from(">BBL", buffer, 3)
            self._on_frame(kind, flags, stream_id & 0x7FFFFFFF, buffer[9:9 + size])
            buffer = buffer[9 + size:]
        return buffer

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if (kind in (DATA, HEADERS) and flags & END_STREAM) or kind == RST_STREAM:
            self.ended_ids.add(stream_id)
        if kind == PING and flags & ACK:
            self.ping_acks.add(payload)
        elif kind in (HEADERS, CONTINUATION):
            if kind == HEADERS:
                start = (1 if flags & PADDED else 0) + (5 if flags & PRIORITY_FLAG else 0)
                end = len(payload) - (payload[0] if flags & PADDED else 0)
                self._block = payload[start:end]
            else:
                self._block += payload
            if flags & END_HEADERS:
                try:
                    self._decoder.decode(self._block, raw=True)
                except HPACKError as exc:
                    self.hpack_errors.append(f"stream {stream_id}: {exc!r}")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What plain h2, given the same bytes as the server, makes of them."""

    error: str | None = None  # a connection error: the server must close the connection
    is_clean: bool = False  # whole frames, no header block left open, the connection open: it must answer
    must_answer: frozenset[int] = field(default_factory=frozenset)  # streams the client ended, not reset
    may_stall: bool = False  # the client shrank its stream window: responses may wait for WINDOW_UPDATEs


def _split_frames(data: bytes) -> list[tuple[int, bytes]]:
    """The preface, then each frame as its header delimits it (stream id, bytes); a cut one last."""
    pieces = [(0, data[:len(PREFACE)])]
    pos = len(PREFACE)
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 3], "big")
        stream_id = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
        pieces.append((stream_id, data[pos:pos + 9 + length]))
        pos += 9 + length
    return pieces


def reference_verdict(config: H2Configuration, data: bytes) -> Verdict:
    """Feeds `data` (preface included), frame by frame, to an h2 server connection configured as the server's.

    NOTE: the reference sends nothing back, so its streams stay open where the server's may have ended or
    been reset (an invalid request's RST_STREAM): an error on a frame for a stream opened before may be a
    connection error here and a stream error there (RFC 9113 5.1), so it is no requirement; nor are flow
    control and the stream limit: the server's windows and limit are larger than h2's defaults used here.
    """
    conn = H2Connection(config=config)
    conn.initiate_connection()
    events: list[Event] = []
    for stream_id, piece in _split_frames(data):
        is_known = stream_id in conn.streams
        try:
            events.extend(conn.receive_data(piece))
        except (FlowControlError, TooManyStreamsError):
            return Verdict()
        except (ProtocolError, UnicodeDecodeError) as exc:  # (the second: a header byte outside the encoding)
            return Verdict() if is_known else Verdict(error=repr(exc))
    buffer = conn.incoming_buffer
    is_clean = (not buffer._data and not buffer._headers_buffer and not buffer._preamble_len
                and conn.state_machine.state is not ConnectionState.CLOSED
                and not any(isinstance(e, ConnectionTerminated) for e in events))
    ended = {e.stream_id for e in events if isinstance(e, StreamEnded)}
    reset = {e.stream_id for e in events if isinstance(e, StreamReset)}
    may_stall = any(
        isinstance(e, RemoteSettingsChanged)
        and (changed := e.changed_settings.get(SettingCodes.INITIAL_WINDOW_SIZE)) is not None
        and changed.new_value < DEFAULT_WINDOW
        for e in events
    )
    return Verdict(is_clean=is_clean, must_answer=frozenset(ended - reset), may_stall=may_stall)
