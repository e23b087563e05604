"""h2's receive path without work whose answer is already known: the open-stream count, and the decoding and
validation of a header block the connection has seen before; a stream past the limit refused alone; and a
bounded memory of closed streams.

Open streams: h2 counts them (to enforce SETTINGS_MAX_CONCURRENT_STREAMS) by walking its whole stream table on
every HEADERS that opens a stream, and drops closed streams from the table on the same walk: at 256
concurrent streams that walk was ~3% of the frontend's CPU. The table's size is an upper bound on the count,
so the walk is only needed when that bound could reach the limit; it also runs once the table has doubled
since the last walk, so closed streams are still dropped and the table stays within twice the open streams.

Closed streams: h2 remembers how each stream it dropped from its table was closed (by END_STREAM, by a reset,
or implicitly), so that a frame arriving on it later is a stream error after a reset and a connection error
otherwise; it keeps 2^16 of them per connection, in an OrderedDict: ~145 bytes a stream, ~9.5 MB on a
long-lived connection before the bound is reached. That was the frontend's creep of ~150 bytes a request
(issue 37, item 4; bench/soak.py). What matters is a frame the client sent before it learnt of a reset, and it
can only come on a stream that was open then: the connection keeps as many closed streams as its stream limit
(`max_closed_streams`), as nghttp2 and Kestrel do. HEADERS on a stream forgotten since get h2's answer for a
stream closed implicitly, a connection error, as RFC 9113 5.1 allows (DATA is a stream error either way).

Streams past the limit: h2 answers a HEADERS frame that would open one stream too many with
TooManyStreamsError, a connection error (GOAWAY PROTOCOL_ERROR): every other stream of the connection was
lost with it. RFC 9113 5.1.2 makes it a stream error, REFUSED_STREAM, which gRPC clients retry (the request
was never processed). The stream is opened as h2 opens any other (its header block HPACK-decoded, which
keeps the decoder's table in step with the client's encoder; its id marked used), then reset with
REFUSED_STREAM at once: the application gets h2's `StreamReset(error_code=REFUSED_STREAM,
remote_reset=False)` instead of its RequestReceived, and DATA the client sent on it meanwhile is answered as
on any stream the server reset (its connection window returned).

Header blocks: a gRPC client sends the same request headers on every call, and once its HPACK encoder has
indexed them the block's bytes repeat too. h2 decoded every block (pure-Python HPACK) and ran it through its
normalization, validation and str-decoding generators: ~50 of the ~90 us h2 spent receiving one Generate
call (HEADERS + DATA) here. Both steps are functions of their inputs, so their results are reused:
- a decoded block, while the decoder's dynamic table is unchanged (the table counts its changes; a block that
  changed it is not kept) and the decoder's limits are the same;
- a processed header list, for an equal list (same header classes: never-indexed ones keep their class)
  under the same validation flags, encoding and configuration.
What fails to decode or validate is never kept: it raises as it did, every time (a field that is not in the
connection's encoding: h2's ProtocolError, a connection error, where h2 let UnicodeDecodeError escape).

Received frames: h2 formats `repr(frame)` (flags, body) for a trace log on every frame it receives, even when
the log goes nowhere (its default logger): ~3 us per frame here. A connection with that default logger gets
frames whose repr is only their type and stream id (the frame buffer hands out subclasses that differ in
nothing else; h2's dispatch table learns them). The two frames of every call (a HEADERS block in one frame,
a DATA frame), neither padded nor with a priority, are built directly rather than through hyperframe's generic
parse (a flag set per frame, a Flag walk, memoryview slicing): the same objects, ~3 us less per call.

Request frames: once both caches above know a client's header block, the frames of its calls need nothing from
h2 but its books: a HEADERS frame (no padding, priority or CONTINUATION) opening a new stream with that block,
a DATA frame (no padding) on an open stream within both flow-control windows. The connection receives those
directly (`_receive_plain_frame`), giving h2's events and leaving h2's stream, state machine and flow-control
windows as h2 would; anything else (another frame or flag, a content-length, a window or stream limit, a block
not seen before, a frame cut between reads) goes to h2, errors included. h2 took ~60 us for a call's HEADERS
and DATA on a busy 2-core machine, this ~28 (tests/unit/test_h2_streams.py compares events, frames and books
with h2's over random traffic).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import TYPE_CHECKING, Any

from h2.config import DummyLogger, H2Configuration
from h2.connection import AllowedStreamIDs, ConnectionState, H2Connection
from h2.errors import ErrorCodes
from h2.events import DataReceived, Event, RequestReceived, StreamEnded, StreamReset
from h2.exceptions import ProtocolError, TooManyStreamsError
from h2.frame_buffer import FrameBuffer
from h2.stream import H2Stream, StreamState
from h2.utilities import HeaderValidationFlags, SizeLimitDict
from hpack import Decoder, HeaderTuple
from hpack.table import HeaderTable
from hyperframe.flags import Flags
from hyperframe.frame import DataFrame, Frame, HeadersFrame

if TYPE_CHECKING:
    from h2._typing import Buffer

_MIN_SCAN_SIZE = 64
_MAX_KEPT = 64  # entries per cache (per connection): cleared when full
_MAX_KEPT_BLOCK = 2048  # bytes: longer blocks (rare, large metadata) are decoded each time
MAX_CLOSED_STREAMS = 1024  # closed streams remembered per connection: the server's default stream limit


class _CountingHeaderTable(HeaderTable):
    """HPACK's dynamic table, counting its changes (insertions and size changes)."""

    version = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.version += 1
        super().add(name, value)

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @maxsize.setter
    def maxsize(self, newmax: int) -> None:
        self.version += 1
        HeaderTable.maxsize.fset(self, newmax)  # type: ignore[attr-defined]


class CachingDecoder(Decoder):
    """An HPACK decoder that answers a block it decoded before, while the table has not changed since."""

    def __init__(self) -> None:
        super().__init__()
        self.header_table: _CountingHeaderTable = _CountingHeaderTable()
        self._kept: dict[tuple[bytes, bool, int, int], tuple[HeaderTuple, ...]] = {}
        self._kept_version = 0

    def kept(self, data: bytes) -> tuple[HeaderTuple, ...] | None:
        """What `decode(data, raw=True)` would answer from what is kept, without decoding (None: not kept)."""
        if self.header_table.version != self._kept_version:
            return None
        return self._kept.get((data, True, self.max_header_list_size, self.max_allowed_table_size))

    def decode(self, data: bytes, raw: bool = False) -> list[HeaderTuple]:
        table = self.header_table
        kept = self._kept
        if table.version != self._kept_version:
            kept.clear()
            self._kept_version = table.version
        key = (bytes(data), raw, self.max_header_list_size, self.max_allowed_table_size)
        headers = kept.get(key)
        if headers is not None:
            return list(headers)
        decoded = list(super().decode(data, raw))
        if table.version == self._kept_version and len(key[0]) <= _MAX_KEPT_BLOCK:
            if len(kept) >= _MAX_KEPT:
                kept.clear()
            kept[key] = tuple(decoded)
        return decoded


class _ProcessedHeaders:
    """h2's header pipeline (normalize, validate, decode to str) remembered for lists seen before."""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    @staticmethod
    def _key(headers: tuple[Any, ...], flags: Any, encoding: Any, config: H2Configuration) -> tuple[Any, ...]:
        return (headers, tuple(map(type, headers)), flags, encoding,
                config.normalize_inbound_headers, config.validate_inbound_headers)

    def kept(self, headers: tuple[Any, ...], flags: Any, encoding: Any,
             config: H2Configuration) -> tuple[Any, ...] | None:
        """What `process` would answer from what is kept, without processing (None: not kept)."""
        return self._kept.get(self._key(headers, flags, encoding, config))

    def process(self, stream: H2Stream, headers: Any, flags: Any, encoding: Any) -> list[Any]:
        headers = tuple(headers)
        key = self._key(headers, flags, encoding, stream.config)
        kept = self._kept
        processed = kept.get(key)
        if processed is not None:
            return list(processed)
        try:
            result: list[Any] = H2Stream._process_received_headers(stream, headers, flags, encoding)
        except UnicodeDecodeError as exc:
            # NOTE: h2 decodes names and values with the configured encoding (grpclib's: ascii) and lets a
            # byte outside it escape `receive_data`: the transport died with a traceback in the log. What h2's
            # own header validation does instead: a connection error (GOAWAY PROTOCOL_ERROR).
            raise ProtocolError(f"a header field is not {encoding}: {exc}") from None
        if sum(len(name) + len(value) for name, value in headers) <= _MAX_KEPT_BLOCK:
            if len(kept) >= _MAX_KEPT:
                kept.clear()
            kept[key] = tuple(result)
        return result


class _RememberingH2Stream(H2Stream):
    _processed: _ProcessedHeaders  # the connection's, set when the stream is created

    def _process_received_headers(self, headers: Any, header_validation_flags: Any,
                                  header_encoding: Any) -> list[Any]:
        return self._processed.process(self, headers, header_validation_flags, header_encoding)


def _quiet_repr(frame: Frame) -> str:
    return f"{type(frame).__bases__[0].__name__}(stream_id={frame.stream_id})"


_QUIET_FRAMES: dict[type[Frame], type[Frame]] = {}  # a frame class -> its subclass with the short repr


def _quiet_class(frame_class: type[Frame]) -> type[Frame]:
    quiet = _QUIET_FRAMES.get(frame_class)
    if quiet is None:
        quiet = type(frame_class.__name__, (frame_class,), {"__repr__": _quiet_repr, "__slots__": ()})
        _QUIET_FRAMES[frame_class] = quiet
    return quiet


# HTTP/2 frame layout (RFC 9113 4.1): what the buffer below parses and api/transport/fast_send.py writes
FRAME_HEADER = struct.Struct(">BHBBL")  # 24-bit length (as 8 + 16 bits), type, flags, stream id
DATA, HEADERS = 0x0, 0x1
END_STREAM, END_HEADERS = 0x1, 0x4
_PADDED, _PRIORITY = 0x8, 0x20
_QUIET_DATA, _QUIET_HEADERS = _quiet_class(DataFrame), _quiet_class(HeadersFrame)
_DATA_FLAG_NAMES = {flag.name for flag in DataFrame.defined_flags}  # (shared by every frame: only read)
_HEADERS_FLAG_NAMES = {flag.name for flag in HeadersFrame.defined_flags}


def _flags(valid: set[str], names: set[str]) -> Flags:
    flags: Flags = Flags.__new__(Flags)
    flags._valid_flags = valid  # (only read: which names add() accepts)
    flags._flags = names
    return flags


def _plain_frame(kind: int, bits: int, stream_id: int, body: bytes) -> Frame:
    """What hyperframe's parse builds for a DATA frame without padding or a HEADERS frame without padding or
    priority (`kind`, flag `bits`, a non-zero stream id)."""
    frame: Any
    if kind == DATA:
        frame = _QUIET_DATA.__new__(_QUIET_DATA)
        frame.flags = _flags(_DATA_FLAG_NAMES, {"END_STREAM"} if bits & END_STREAM else set())
    else:
        frame = _QUIET_HEADERS.__new__(_QUIET_HEADERS)
        names = {"END_HEADERS"} if bits & END_HEADERS else set()
        if bits & END_STREAM:
            names.add("END_STREAM")
        frame.flags = _flags(_HEADERS_FLAG_NAMES, names)
        frame.depends_on, frame.stream_weight, frame.exclusive = 0, 0, False
    frame.stream_id = stream_id
    frame.body_len = len(body)
    frame.pad_length = 0
    frame.data = body
    built: Frame = frame
    return built


class _QuietFrameBuffer(FrameBuffer):
    def __next__(self) -> Frame:
        data = self._data
        if len(data) >= 9 and not self._headers_buffer:
            high, low, kind, bits, stream_id = FRAME_HEADER.unpack_from(data)
            length = (high << 16) | low
            stream_id &= 0x7FFFFFFF
            plain = ((kind == DATA and not bits & _PADDED)
                     or (kind == HEADERS and bits & (END_HEADERS | _PADDED | _PRIORITY) == END_HEADERS))
            if plain and stream_id and len(data) >= 9 + length:
                self._validate_frame_length(length)
                frame = _plain_frame(kind, bits, stream_id, bytes(data[9:9 + length]))
                del data[:9 + length]
                return frame
        frame = super().__next__()
        quiet = _QUIET_FRAMES.get(type(frame))
        if quiet is not None:
            frame.__class__ = quiet
        return frame


# A request's header block as h2 validates it on a server (the flags h2 builds for a RequestReceived)
_REQUEST_FLAGS = HeaderValidationFlags(is_client=False, is_trailer=False, is_response_header=False,
                                       is_push_promise=False)
# Headers that take h2's own path: a status (an informational response: not a request) and a content length
# (h2 then counts the body)
_NOT_PLAIN_REQUEST_HEADERS = frozenset({b":status", b"content-length"})
# NOTE: h2 >= 4.2 builds its events as keyword dataclasses (as here); with an older h2, h2 receives everything
_FAST_RECEIVE = all(dataclasses.is_dataclass(event) for event in (RequestReceived, DataReceived, StreamEnded))


class LazyCountingH2Connection(H2Connection):
    """An H2Connection whose `_open_streams` walks the table only when the answer could matter, whose streams
    reuse processed header lists, and which refuses a stream past the limit alone (see the module's
    docstring)."""

    _scan_above = 0  # the table size after the last walk, doubled (a class default: set on first use)
    _processed: _ProcessedHeaders | None = None  # set by `use_lazy_counting`
    _is_refusing = False  # True while a stream past the limit is opened, to be refused at once

    def _open_streams(self, remainder: int) -> int:
        if self._is_refusing:
            return 0
        size = len(self.streams)
        is_inbound = remainder == int(not self.config.client_side)
        settings = self.local_settings if is_inbound else self.remote_settings
        limit = settings.max_concurrent_streams
        if size + 1 <= limit and size < self._scan_above:
            # NOTE: every caller compares `count + 1` with a limit; the table size is at least the count.
            return size
        count = super()._open_streams(remainder)
        self._scan_above = max(2 * len(self.streams), _MIN_SCAN_SIZE)
        return count

    def receive_data(self, data: Buffer) -> list[Event]:
        """h2's receive_data, with the frames at the front of `data` that need nothing from h2 beyond its
        books received here (see `_receive_plain_frame`), and the rest by h2."""
        if type(data) is not bytes or not self._receives_plain_frames():
            return super().receive_data(data)
        events: list[Event] = []
        offset, size = 0, len(data)
        while offset < size:
            taken = self._receive_plain_frame(data, offset, events)
            if not taken:
                break
            offset += taken
        if offset == 0:
            return super().receive_data(data)
        if offset < size:
            events.extend(super().receive_data(data[offset:]))
        return events

    def _receives_plain_frames(self) -> bool:
        buffer = self.incoming_buffer
        return (_FAST_RECEIVE and self._processed is not None and type(self.decoder) is CachingDecoder
                and not buffer._data and not buffer._headers_buffer and not buffer._preamble_len
                and self.state_machine.state is ConnectionState.SERVER_OPEN)

    def _receive_plain_frame(self, data: bytes, offset: int, events: list[Event]) -> int:
        """The whole frame at `offset` if it is a request's HEADERS (one frame, no padding or priority)
        opening a new stream with a header block this connection decoded and validated before, or a DATA frame
        (no padding) on an open stream within both flow-control windows: adds the events h2 would give, keeps
        h2's books as h2 would (the stream, its state, both windows) and returns the frame's size. 0: none of
        those, nothing changed (h2 then receives it, errors included).

        NOTE: h2 spent ~60 us on a call's two frames on a busy 2-core machine (frame objects, two state
        machines, header processing, events), ~28 here: the frames of a gRPC client's calls once its HPACK
        encoder has indexed its headers.
        """
        if len(data) - offset < 9:
            return 0
        high, low, kind, bits, stream_id = FRAME_HEADER.unpack_from(data, offset)
        length = (high << 16) | low
        end = offset + 9 + length
        stream_id &= 0x7FFFFFFF
        if end > len(data) or length > self.max_inbound_frame_size or not stream_id:
            return 0
        if kind == HEADERS and bits & ~END_STREAM == END_HEADERS:
            return self._receive_request_headers(data, offset, end, stream_id, bits & END_STREAM, events)
        if kind == DATA and not bits & ~END_STREAM:
            return self._receive_request_data(data, offset, end, stream_id, bits & END_STREAM, events)
        return 0

    def _receive_request_headers(self, data: bytes, offset: int, end: int, stream_id: int, end_stream: int,
                                 events: list[Event]) -> int:
        settings = self.local_settings
        if (not stream_id & 1 or stream_id <= self.highest_inbound_stream_id or stream_id in self.streams
                or self._open_streams(1) + 1 > settings.max_concurrent_streams):  # (open_inbound_streams)
            return 0
        decoder, processed = self.decoder, self._processed
        assert isinstance(decoder, CachingDecoder)  # (_receives_plain_frames)
        assert processed is not None
        raw = decoder.kept(data[offset + 9:end])
        if raw is None or any(name in _NOT_PLAIN_REQUEST_HEADERS for name, _ in raw):
            return 0
        headers = processed.kept(raw, _REQUEST_FLAGS, self.config.header_encoding, self.config)
        if headers is None:
            return 0
        # What h2 does (the connection stays SERVER_OPEN): RECV_HEADERS, IDLE -> OPEN (`request_received`),
        # then with END_STREAM, RECV_END_STREAM, OPEN -> HALF_CLOSED_REMOTE (`stream_half_closed`).
        machine = self._begin_new_stream(stream_id, AllowedStreamIDs.ODD).state_machine
        machine.client = False
        machine.headers_received = True
        request = RequestReceived(stream_id=stream_id, headers=list(headers))
        events.append(request)
        if end_stream:
            machine.state = StreamState.HALF_CLOSED_REMOTE
            request.stream_ended = StreamEnded(stream_id=stream_id)
            events.append(request.stream_ended)
        else:
            machine.state = StreamState.OPEN
        return end - offset

    def _receive_request_data(self, data: bytes, offset: int, end: int, stream_id: int, end_stream: int,
                              events: list[Event]) -> int:
        stream = self.streams.get(stream_id)
        size = end - offset - 9
        if (stream is None or stream.state_machine.state is not StreamState.OPEN
                or stream._expected_content_length is not None
                or size > self._inbound_flow_control_window_manager.current_window_size
                or size > stream._inbound_window_manager.current_window_size):
            return 0
        # What h2 does: the connection's window, then RECV_DATA (`data_received`: OPEN stays OPEN) and the
        # stream's window and body count, then with END_STREAM, OPEN -> HALF_CLOSED_REMOTE.
        self._inbound_flow_control_window_manager.window_consumed(size)
        stream._inbound_window_manager.window_consumed(size)
        stream._actual_content_length += size
        received = DataReceived(stream_id=stream_id, data=data[offset + 9:end], flow_controlled_length=size)
        events.append(received)
        if end_stream:
            stream.state_machine.state = StreamState.HALF_CLOSED_REMOTE
            received.stream_ended = StreamEnded(stream_id=stream_id)
            events.append(received.stream_ended)
        return end - offset

    def _receive_headers_frame(self, frame: HeadersFrame) -> tuple[list[Frame], list[Event]]:
        try:
            return super()._receive_headers_frame(frame)
        except TooManyStreamsError:
            # NOTE: h2 raises it before anything changed (tests/security/test_transport_internals.py)
            return self._refuse_stream(frame)

    def _refuse_stream(self, frame: HeadersFrame) -> tuple[list[Frame], list[Event]]:
        """A HEADERS frame opening a stream past SETTINGS_MAX_CONCURRENT_STREAMS: the stream opened as h2
        opens any (errors too: a malformed block is the same connection error as below the limit), then
        reset with REFUSED_STREAM; its events replaced by that reset's."""
        self._is_refusing = True
        try:
            frames, _ = super()._receive_headers_frame(frame)
        finally:
            self._is_refusing = False
        self.reset_stream(frame.stream_id, error_code=ErrorCodes.REFUSED_STREAM)
        refused = StreamReset(stream_id=frame.stream_id, error_code=ErrorCodes.REFUSED_STREAM,
                              remote_reset=False)
        return frames, [refused]

    def _begin_new_stream(self, stream_id: int, allowed_ids: AllowedStreamIDs) -> H2Stream:
        stream = super()._begin_new_stream(stream_id, allowed_ids)
        processed = self._processed
        if processed is not None and type(stream) is H2Stream:
            stream.__class__ = _RememberingH2Stream
            stream._processed = processed  # type: ignore[attr-defined]
        return stream


def use_lazy_counting(connection: H2Connection, *, max_closed_streams: int = MAX_CLOSED_STREAMS) -> None:
    """Switch a connection grpclib created (it builds a plain H2Connection), before it has received anything,
    to the lazy count and the remembered header blocks, remembering at most `max_closed_streams` closed
    streams (h2: 2^16; see the module's docstring)."""
    if type(connection) is not H2Connection:
        return
    connection.__class__ = LazyCountingH2Connection
    kept = min(max_closed_streams, H2Connection.MAX_CLOSED_STREAMS)
    closed_streams: Any = connection._closed_streams  # (h2's annotation of SizeLimitDict's argument is off)
    connection._closed_streams = SizeLimitDict(closed_streams, size_limit=kept)
    decoder = connection.decoder
    if type(decoder) is Decoder and not decoder.header_table.dynamic_entries:
        caching = CachingDecoder()
        caching.max_header_list_size = decoder.max_header_list_size
        caching.max_allowed_table_size = decoder.max_allowed_table_size
        caching.header_table.maxsize = decoder.header_table.maxsize
        connection.decoder = caching
    connection._processed = _ProcessedHeaders()  # type: ignore[attr-defined]
    dispatch = connection._frame_dispatch_table
    # NOTE: h2 binds its frame handlers when the connection is made: the refusal past the limit is ours only
    # through this table
    dispatch[HeadersFrame] = connection._receive_headers_frame
    if type(connection.config.logger) is DummyLogger and type(connection.incoming_buffer) is FrameBuffer:
        for frame_class in list(dispatch):
            dispatch[_quiet_class(frame_class)] = dispatch[frame_class]
        connection.incoming_buffer.__class__ = _QuietFrameBuffer
