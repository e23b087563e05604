"""api/transport/h2_streams.py: the lazy open-stream count behaves exactly like h2's own (same events, same
frames) and still drops closed streams from the table; a stream past the limit is refused alone (RST_STREAM
REFUSED_STREAM, RFC 9113 5.1.2), where h2 fails the whole connection."""

from __future__ import annotations

import contextlib
import random
import struct
from typing import Any

import pytest
from engine_server.api.transport.h2_streams import CachingDecoder, LazyCountingH2Connection, use_lazy_counting
from h2.config import H2Configuration
from h2.connection import ConnectionState, H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import ProtocolError, TooManyStreamsError
from h2.settings import SettingCodes
from h2.stream import StreamState
from hpack import Decoder, Encoder, NeverIndexedHeaderTuple, OversizedHeaderListError
from hyperframe.frame import Frame

LIMIT = 20
REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", "/x"), (":authority", "a")]
RESPONSE = [(":status", "200")]


def _pair(
    *, lazy: bool, limit: int | None = None, client_config: H2Configuration | None = None,
    server_config: H2Configuration | None = None, max_closed_streams: int | None = None,
) -> tuple[H2Connection, H2Connection]:
    """A client and a server connection past the preface and SETTINGS exchange (lazy: the server is ours)."""
    client = H2Connection(client_config or H2Configuration(client_side=True))
    server = H2Connection(server_config or H2Configuration(client_side=False))
    if lazy and max_closed_streams is not None:
        use_lazy_counting(server, max_closed_streams=max_closed_streams)
    elif lazy:
        use_lazy_counting(server)
    client.initiate_connection()
    server.initiate_connection()
    if limit is not None:
        server.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: limit})
    for _ in range(2):  # preface and SETTINGS both ways, then the ACKs
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())
    return client, server


def _run(script: list[tuple[str, int]], *, lazy: bool, limit: int = LIMIT) -> tuple[list[str], list[int]]:
    """Until h2 refuses a stream over the limit (it raises TooManyStreamsError from receive_data; ours goes
    on, answering each stream past it with a StreamReset)."""
    client, server = _pair(lazy=lazy, limit=limit)
    client.remote_settings._settings[SettingCodes.MAX_CONCURRENT_STREAMS].append(2**31 - 1)
    client.remote_settings.acknowledge()
    log: list[str] = []
    table_sizes = []
    open_ids: list[int] = []
    for action, value in script:
        if action == "open":
            stream_id = client.get_next_available_stream_id()
            client.send_headers(stream_id, REQUEST, end_stream=True)
            open_ids.append(stream_id)
        elif open_ids:  # the server answers one of its open streams and ends it
            stream_id = open_ids.pop(value % len(open_ids))
            if stream_id in server.streams and server.streams[stream_id].open:
                server.send_headers(stream_id, RESPONSE, end_stream=True)
        try:
            events = server.receive_data(client.data_to_send())
        except TooManyStreamsError as exc:
            log.append(repr(exc))
            break
        log.extend(type(event).__name__ + str(getattr(event, "stream_id", "")) for event in events)
        reply = server.data_to_send()
        log.append(reply.hex())
        client.receive_data(reply)
        table_sizes.append(len(server.streams))
    return log, table_sizes


def _script(seed: int, *, max_open: int, length: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    script: list[tuple[str, int]] = []
    num_open = 0
    for _ in range(length):
        action = "open" if num_open < max_open and (num_open == 0 or rng.random() < 0.5) else "close"
        num_open += 1 if action == "open" else -1
        script.append((action, rng.randrange(1000)))
    return script


def test_same_events_and_frames_as_h2_up_to_the_limit_then_refusals_alone() -> None:
    # A long run just below the limit (the table fills with closed streams), then past it.
    script = _script(7, max_open=LIMIT - 1, length=3000) + [("open", 0)] * (LIMIT + 1)
    lazy_log, lazy_sizes = _run(script, lazy=True)
    plain_log, _ = _run(script, lazy=False)
    assert "TooManyStreamsError" in plain_log[-1]  # h2: the limit reached, the whole connection failed
    assert len(plain_log) > 1000  # ... after a long run below it
    at_limit = len(plain_log) - 1
    assert lazy_log[:at_limit] == plain_log[:at_limit]
    # ours: that stream refused alone, and so is every one opened after it while the others stay open
    assert lazy_log[at_limit].startswith("StreamReset")
    assert not any(entry.startswith("RequestReceived") for entry in lazy_log[at_limit:])
    assert len(lazy_log) > len(plain_log) + 10  # (the connection went on)
    assert max(lazy_sizes) <= 2 * LIMIT + 64  # closed streams are still dropped


def test_closed_streams_are_dropped_far_below_a_high_limit() -> None:
    script = _script(11, max_open=LIMIT, length=3000)
    lazy_log, lazy_sizes = _run(script, lazy=True, limit=10_000)
    assert lazy_log == _run(script, lazy=False, limit=10_000)[0]
    assert max(lazy_sizes) <= 2 * (LIMIT + 1) + 64  # the table is walked once it doubles, not at the limit


def _late_trailers_after_calls(num_calls: int, *, max_closed_streams: int) -> bool:
    """The server resets a stream whose request is still open, serves `num_calls` calls, then receives the
    request's trailers, which the client sent before it saw the reset: True if that is a stream error
    (RST_STREAM STREAM_CLOSED, the connection serves on), False if a connection error (the stream is
    forgotten)."""
    client, server = _pair(lazy=True, max_closed_streams=max_closed_streams)
    reset_id = client.get_next_available_stream_id()
    client.send_headers(reset_id, GRPC_REQUEST)
    server.receive_data(client.data_to_send())
    server.reset_stream(reset_id, error_code=ErrorCodes.CANCEL)
    server.data_to_send()  # (the client does not read the reset before it sends its trailers)
    for _ in range(num_calls):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, GRPC_REQUEST, end_stream=True)
        server.receive_data(client.data_to_send())
        server.send_headers(stream_id, RESPONSE, end_stream=True)
        client.receive_data(server.data_to_send())
    client.send_headers(reset_id, [("x-trailer", "1")], end_stream=True)
    try:
        server.receive_data(client.data_to_send())
    except ProtocolError:
        return False
    answer = client.receive_data(server.data_to_send())
    assert [(e.stream_id, e.error_code) for e in answer if isinstance(e, StreamReset)] == [
        (reset_id, ErrorCodes.STREAM_CLOSED)]
    return server.state_machine.state is not ConnectionState.CLOSED


def test_closed_streams_are_remembered_up_to_a_bound() -> None:
    # h2 remembered 2^16 closed streams per connection (~145 bytes each: the frontend's memory grew with every
    # call on a long-lived connection); ours keeps the last `max_closed_streams`, enough for the frames a
    # client sends before it reads a reset. NOTE: 200 calls pass several walks of the stream table (closed
    # streams are remembered once a walk drops them from it).
    assert _late_trailers_after_calls(200, max_closed_streams=256)
    assert not _late_trailers_after_calls(200, max_closed_streams=32)
    assert _late_trailers_after_calls(5, max_closed_streams=32)  # (still in the table)


def test_only_plain_connections_are_switched() -> None:
    connection = H2Connection(H2Configuration(client_side=False))
    use_lazy_counting(connection)
    assert type(connection) is LazyCountingH2Connection


# --- remembered header blocks -------------------------------------------------------------------------


def _header_sets(seed: int, count: int) -> list[list[Any]]:
    """Mostly the same request headers (as a gRPC client sends them), sometimes a new value (an insertion
    into the dynamic table), or one header never indexed (sensitive) in some lists and indexed in others."""
    rng = random.Random(seed)
    sets = []
    for i in range(count):
        headers: list[Any] = [*REQUEST, ("content-type", "application/grpc"), ("te", "trailers")]
        roll = rng.random()
        if roll < 0.2:
            headers.append(("grpc-timeout", f"{rng.randrange(1, 50)}m"))
        elif roll < 0.3:
            headers.append(("x-request", str(i)))
        elif roll < 0.4:  # NOTE: never indexed first: once indexed, hpack's encoder sends it indexed anyway
            headers.append(NeverIndexedHeaderTuple(b"x-key", b"k") if i < count // 2 else ("x-key", "k"))
        sets.append(headers)
    return sets


def test_caching_decoder_decodes_as_hpack_does_and_reuses_repeated_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    encoder, plain, caching = Encoder(), Decoder(), CachingDecoder()
    decoded_by_hpack = [0]
    hpack_decode = Decoder.decode

    def counting_decode(self: Decoder, data: bytes, raw: bool = False) -> object:
        decoded_by_hpack[0] += self is caching
        return hpack_decode(self, data, raw)

    monkeypatch.setattr(Decoder, "decode", counting_decode)
    for number, headers in enumerate(_header_sets(3, 400)):
        if number == 150:
            encoder.header_table_size = 256  # a size update leads the next block: the table shrinks
            plain.header_table_size = caching.header_table_size = 256
        block_headers: list[Any] = list(headers)
        if number % 17 == 0:
            block_headers.append(NeverIndexedHeaderTuple("authorization", "secret"))
        block = encoder.encode(block_headers)
        expected = list(plain.decode(block, raw=True))
        got = caching.decode(block, raw=True)
        assert got == expected
        assert [type(h) for h in got] == [type(h) for h in expected]
        assert list(plain.header_table.dynamic_entries) == list(caching.header_table.dynamic_entries)
    assert decoded_by_hpack[0] < 330  # of 400 (~280): the repeated blocks were answered from the cache


def test_caching_decoder_applies_a_lowered_header_list_limit_to_a_kept_block() -> None:
    encoder, caching = Encoder(), CachingDecoder()
    headers = [("a", "x" * 100)]
    caching.decode(encoder.encode(headers))  # inserted into the table: this block is not kept
    block = encoder.encode(headers)  # now indexed: kept
    caching.decode(block)
    caching.decode(block)
    caching.max_header_list_size = 50
    with pytest.raises(OversizedHeaderListError):
        caching.decode(block)


def _serve(header_sets: list[list[Any]], *, lean: bool, validate: bool) -> list[object]:
    client, server = _pair(
        lazy=lean,
        client_config=H2Configuration(  # sends what it is given, even an illegal header
            client_side=True, header_encoding="ascii", validate_outbound_headers=False,
            normalize_outbound_headers=False),
        server_config=H2Configuration(
            client_side=False, header_encoding="ascii", validate_inbound_headers=validate,
            normalize_inbound_headers=validate),
    )
    log: list[object] = []
    for headers in header_sets:
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, headers, end_stream=True)
        try:
            events = server.receive_data(client.data_to_send())
        except ProtocolError as exc:
            log.append(repr(exc))
            break
        for event in events:
            found = getattr(event, "headers", None)
            log.append((type(event).__name__, found, [type(h) for h in found or ()]))
            if found is not None:
                server.send_headers(getattr(event, "stream_id"), RESPONSE, end_stream=True)  # noqa: B009
        reply = server.data_to_send()
        log.append(reply)
        client.receive_data(reply)
    return log


@pytest.mark.parametrize("validate", [True, False])
def test_remembered_header_processing_gives_h2s_events(validate: bool) -> None:
    sets = _header_sets(5, 300)
    assert _serve(sets, lean=True, validate=validate) == _serve(sets, lean=False, validate=validate)


def test_an_invalid_header_list_is_refused_as_h2_refuses_it() -> None:
    bad = [*REQUEST, ("connection", "keep-alive")]  # a connection-specific header: illegal in HTTP/2
    log = _serve([REQUEST, REQUEST, bad], lean=True, validate=True)
    assert "ProtocolError" in str(log[-1])
    assert log == _serve([REQUEST, REQUEST, bad], lean=False, validate=True)


def test_a_header_field_outside_the_encoding_is_a_connection_error() -> None:
    # grpclib's configuration (header_encoding="ascii", validation off): h2 let the UnicodeDecodeError of a
    # non-ASCII value escape receive_data, and the server's transport died with a traceback in its log.
    config = H2Configuration(client_side=False, header_encoding="ascii", validate_inbound_headers=False)
    client, server = _pair(lazy=True, server_config=config)
    assert type(server) is LazyCountingH2Connection
    client.send_headers(1, REQUEST, end_stream=True)
    server.receive_data(client.data_to_send())  # an ASCII request: served
    client.send_headers(3, [*REQUEST, ("x-name", "caf\u00e9")], end_stream=True)
    with pytest.raises(ProtocolError, match="not ascii"):
        server.receive_data(client.data_to_send())
    events = client.receive_data(server.data_to_send())
    assert [(type(e).__name__, getattr(e, "error_code", None)) for e in events] == [
        ("ConnectionTerminated", ErrorCodes.PROTOCOL_ERROR)]


def test_received_frames_skip_the_long_repr_only_without_a_logger() -> None:
    import logging

    from h2.frame_buffer import FrameBuffer

    quiet = H2Connection(H2Configuration(client_side=False))
    use_lazy_counting(quiet)
    assert type(quiet.incoming_buffer) is not FrameBuffer
    logger: Any = logging.getLogger("h2-trace")
    traced = H2Connection(H2Configuration(client_side=False, logger=logger))
    use_lazy_counting(traced)
    assert type(traced.incoming_buffer) is FrameBuffer  # a real logger still gets h2's full frame reprs
    client = H2Connection(H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, REQUEST, end_stream=True)
    data = client.data_to_send()
    quiet.incoming_buffer.max_frame_size = 16384  # (receive_data sets it before reading)
    quiet.incoming_buffer.add_data(data)
    frames = list(quiet.incoming_buffer)
    assert [repr(frame) for frame in frames] == ["SettingsFrame(stream_id=0)", "HeadersFrame(stream_id=1)"]
    assert all(isinstance(frame, Frame) for frame in frames)


def _frame_bytes(kind: int, flags: int, stream_id: int, body: bytes) -> bytes:
    return (len(body).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + body)


_FRAME_FIELDS = ("data", "pad_length", "depends_on", "stream_weight", "exclusive", "window_increment",
                 "error_code")


def _frames_and_errors(buffer_class: type, chunks: list[bytes], max_frame_size: int) -> list[Any]:
    buffer = buffer_class(server=False)
    buffer.max_frame_size = max_frame_size
    seen: list[Any] = []
    for chunk in chunks:
        buffer.add_data(chunk)
        try:
            for frame in buffer:
                seen.append((type(frame).__name__, frame.type, frame.stream_id, sorted(frame.flags),
                             frame.body_len, {name: getattr(frame, name, None) for name in _FRAME_FIELDS}))
        except Exception as exc:  # the same error at the same place, or the test fails
            seen.append((type(exc).__name__, str(exc)))
            break
    return seen


def test_plain_frames_are_built_as_hyperframe_parses_them() -> None:
    """Random frame sequences, cut at random places: the same frames (class, flags, fields) or the same error
    as h2's own buffer, whichever way each frame was built."""
    from engine_server.api.transport.h2_streams import _QuietFrameBuffer
    from h2.frame_buffer import FrameBuffer

    rng = random.Random(7)
    kinds = [
        (0, 0x0), (0, 0x1), (0, 0x8), (0, 0x9), (0, 0x2 | 0x40),  # DATA: end, padded, undefined bits
        (1, 0x4), (1, 0x5), (1, 0x4 | 0x20), (1, 0x4 | 0x8), (1, 0x4 | 0x2), (1, 0x0),  # HEADERS
        (9, 0x4), (8, 0x0), (3, 0x0), (4, 0x0), (6, 0x0), (0x42, 0x0),  # CONTINUATION, others, unknown
    ]
    for trial in range(300):
        wire = b""
        for _ in range(rng.randrange(1, 8)):
            kind, flags = rng.choice(kinds)
            stream_id = rng.choice([1, 3, 5, 2**31 - 1, (1 << 31) | 7]) if kind not in (4, 6) else 0
            if rng.random() < 0.05:
                stream_id = 0  # DATA/HEADERS on stream 0: hyperframe refuses the frame
            body = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 4, 8, 40])))
            if kind == 8:
                body = (1).to_bytes(4, "big")
            elif kind == 3:
                body = (8).to_bytes(4, "big")
            elif kind == 6:
                body = bytes(8)
            elif kind == 4:
                body = b""
            elif flags & 0x8:  # a pad length byte, sometimes too long
                body = bytes([rng.choice([0, 2, 200])]) + body + bytes(2)
            if kind == 1 and flags & 0x20:
                body = bytes(5) + body
            wire += _frame_bytes(kind, flags, stream_id, body)
        cuts = sorted(rng.sample(range(1, len(wire)), min(3, len(wire) - 1))) if len(wire) > 1 else []
        chunks = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
        max_size = rng.choice([16384, 30])
        expected = _frames_and_errors(FrameBuffer, chunks, max_size)
        assert _frames_and_errors(_QuietFrameBuffer, chunks, max_size) == expected, trial


# --- whole calls received past h2's frame machinery -------------------------------------------------------

GRPC_REQUEST = [*REQUEST, ("content-type", "application/grpc"), ("te", "trailers")]


def _event_view(event: Any) -> tuple[Any, ...]:
    ended = getattr(event, "stream_ended", None)
    return (type(event).__name__, getattr(event, "stream_id", None), getattr(event, "headers", None),
            bytes(getattr(event, "data", b"")), getattr(event, "flow_controlled_length", None),
            None if ended is None else (type(ended).__name__, ended.stream_id))


def _books(server: H2Connection) -> tuple[Any, ...]:
    """What h2 keeps of the calls: every stream not closed (its state machine and windows), the connection's.

    NOTE: not `open_inbound_streams` or closed streams: the lazy count leaves closed streams in the table
    longer than h2 (see above), which is not what these tests are about."""
    streams = {}
    for stream_id, stream in sorted(server.streams.items()):
        if stream.closed:
            continue
        machine = stream.state_machine
        streams[stream_id] = (
            machine.state, machine.client, machine.headers_received, machine.trailers_received,
            machine.headers_sent, machine.stream_closed_by,
            stream._inbound_window_manager.current_window_size, stream.outbound_flow_control_window,
            stream._expected_content_length, stream._actual_content_length, stream.max_outbound_frame_size)
    return (server.state_machine.state, server.highest_inbound_stream_id,
            server._inbound_flow_control_window_manager.current_window_size, streams)


def _calls(seed: int, length: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    kinds = ["call"] * 12 + ["batch", "split", "content-length", "no-data-end", "answer", "answer", "ping",
                             "reset", "window", "new-header", "end-in-headers", "apart", "apart", "more-data",
                             "padded", "priority", "stray-data"]
    return [(rng.choice(kinds), rng.randrange(1 << 16)) for _ in range(length)]


def _receive_calls(script: list[tuple[str, int]], *, lean: bool, limit: int) -> tuple[list[Any], int]:
    """The script's client traffic into a server connection (ours when `lean`), logging its events, the bytes
    it answers and its books after each read; and how many frames took the lean path."""
    client, server = _pair(lazy=lean, limit=limit)
    client.remote_settings._settings[SettingCodes.MAX_CONCURRENT_STREAMS].append(2**31 - 1)
    client.remote_settings.acknowledge()
    taken = [0]
    if lean:
        receive_frame = server._receive_plain_frame  # type: ignore[attr-defined]

        def counting(data: bytes, offset: int, events: list[Any]) -> int:
            found: int = receive_frame(data, offset, events)
            taken[0] += found > 0
            return found

        server._receive_plain_frame = counting  # type: ignore[attr-defined]
    log: list[Any] = []
    for action, value in script:
        body = bytes(value % 700)
        headers = GRPC_REQUEST
        reads: list[bytes] = []
        if action in ("call", "batch", "split", "content-length", "wrong-length", "big", "new-header",
                      "end-in-headers"):
            count = 1 + value % 5 if action == "batch" else 1
            if action in ("content-length", "wrong-length"):
                length = len(body) + (action == "wrong-length")
                headers = [*GRPC_REQUEST, ("content-length", str(length))]
            elif action == "new-header":
                headers = [*GRPC_REQUEST, ("x-call", str(value))]  # a new value: the HPACK table changes
            elif action == "big":
                body = bytes(70_000)  # past the 65,535-byte windows: h2 refuses it
            # (a content-length's HEADERS and DATA in reads of their own when `value` is odd: h2 then counts a
            # body on a stream it opened itself)
            apart = action in ("content-length", "wrong-length") and value % 2 == 1
            for _ in range(count):
                stream_id = client.get_next_available_stream_id()
                client.send_headers(stream_id, headers, end_stream=action == "end-in-headers")
                if apart:
                    reads.append(client.data_to_send())
                if action != "end-in-headers":
                    client.max_outbound_frame_size = 1 << 20  # (let the client write a frame too large)
                    client.outbound_flow_control_window = 1 << 30
                    client.streams[stream_id].outbound_flow_control_window = 1 << 30
                    client.send_data(stream_id, body, end_stream=True)
            data = client.data_to_send()
            reads += [data[:value % len(data)], data[value % len(data):]] if action == "split" else [data]
        elif action in ("no-data-end", "apart", "padded", "priority"):
            # HEADERS, then DATA: without END_STREAM (a streaming request, more may follow), in reads of their
            # own, padded, or HEADERS with a priority
            stream_id = client.get_next_available_stream_id()
            weight = value % 256 if action == "priority" else None
            client.send_headers(stream_id, GRPC_REQUEST, priority_weight=weight)
            headers_frame = client.data_to_send()
            client.send_data(stream_id, body, end_stream=action != "no-data-end",
                             pad_length=value % 200 if action == "padded" else None)
            data_frame = client.data_to_send()
            reads = [headers_frame, data_frame] if action == "apart" else [headers_frame + data_frame]
        elif action == "more-data":  # more of an open request stream's body, its end or not
            open_ids = [sid for sid, stream in sorted(client.streams.items())
                        if stream.state_machine.state == StreamState.OPEN]
            if open_ids:
                client.send_data(open_ids[value % len(open_ids)], body, end_stream=value % 3 == 0)
                reads = [client.data_to_send()]
        elif action == "stray-data":  # a DATA frame on a stream the client has ended (h2 resets the stream)
            ends = (StreamState.HALF_CLOSED_LOCAL, StreamState.CLOSED)
            ended = [sid for sid, stream in client.streams.items() if stream.state_machine.state in ends]
            if ended:
                reads = [struct.pack(">BHBBL", 0, 3, 0, 0, ended[value % len(ended)]) + b"abc"]
        elif action == "answer":  # the server answers and ends one of its half-closed streams
            for stream_id, stream in sorted(server.streams.items()):
                half_closed = stream.state_machine.state == StreamState.HALF_CLOSED_REMOTE
                if half_closed and stream_id % 7 != value % 7:
                    server.send_headers(stream_id, RESPONSE, end_stream=True)
                    break
        elif action == "ping":
            client.ping(value.to_bytes(8, "big"))
            reads = [client.data_to_send()]
        elif action == "reset":
            open_ids = [sid for sid, stream in client.streams.items() if stream.open]
            if open_ids:
                client.reset_stream(open_ids[value % len(open_ids)])
                reads = [client.data_to_send()]
        elif action == "window":
            client.increment_flow_control_window(1 + value)
            reads = [client.data_to_send()]
        elif action == "narrow":  # new streams get a 100-byte window (the client acknowledges it first)
            server.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 100})
        for read in reads:
            try:
                events = server.receive_data(read)
            except ProtocolError as exc:
                log.extend([repr(exc), server.data_to_send(), _books(server)])  # (h2 queued a GOAWAY)
                return log, taken[0]
            log.append([_event_view(event) for event in events])
            for event in events:
                if isinstance(event, DataReceived):
                    server.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        reply = server.data_to_send()
        log.append(reply)
        log.append(_books(server))
        with contextlib.suppress(ProtocolError):
            client.receive_data(reply)
    return log, taken[0]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_calls_received_past_h2_give_h2s_events_frames_and_books(seed: int) -> None:
    script = _calls(seed, 600)
    lean_log, num_lean = _receive_calls(script, lean=True, limit=10_000)
    plain_log, num_plain = _receive_calls(script, lean=False, limit=10_000)
    assert num_plain == 0
    assert num_lean > 200  # most calls took the lean path (after the first: HPACK indexes the headers)
    assert len(lean_log) == len(plain_log)
    for step, (lean, plain) in enumerate(zip(lean_log, plain_log, strict=True)):
        assert lean == plain, f"step {step}"


@pytest.mark.parametrize("fatal", [[("big", 10)], [("narrow", 0), ("call", 10), ("call", 500)],
                                   [("wrong-length", 10)], [("wrong-length", 11)]])
def test_a_call_h2_refuses_is_refused_the_same(fatal: list[tuple[str, int]]) -> None:
    """A frame past the frame size and windows (70,000 bytes), a body past a stream's window (500 bytes into
    100), a body unlike its content-length (its HEADERS and DATA in one read, or in two): h2's error, after
    calls taken lean."""
    script = [("call", 10)] * 5 + fatal
    lean_log, num_lean = _receive_calls(script, lean=True, limit=LIMIT)
    assert lean_log == _receive_calls(script, lean=False, limit=LIMIT)[0]
    assert "Error" in lean_log[-3]
    assert num_lean >= 3


def test_a_call_past_the_stream_limit_is_refused_alone_where_h2_fails_the_connection() -> None:
    script = [("call", 10)] * (LIMIT + 2)
    lean_log, num_lean = _receive_calls(script, lean=True, limit=LIMIT)
    plain_log = _receive_calls(script, lean=False, limit=LIMIT)[0]
    assert "TooManyStreamsError" in plain_log[-3]
    at_limit = len(plain_log) - 3
    assert lean_log[:at_limit] == plain_log[:at_limit]
    assert num_lean >= LIMIT - 2
    # each call past the limit: one StreamReset event (its DATA answered as on any stream the server reset),
    # the connection open
    past = [view for views in lean_log[at_limit:] if isinstance(views, list) for view in views]
    assert [view[:2] for view in past] == [("StreamReset", 2 * LIMIT + 1), ("StreamReset", 2 * LIMIT + 3)]
    assert lean_log[-1][0] is not ConnectionState.CLOSED


def _over_limit_pair(limit: int) -> tuple[H2Connection, H2Connection]:
    """Ours with `limit` in force, and a client that sends as if there were none."""
    client, server = _pair(lazy=True, limit=limit)
    client.remote_settings._settings[SettingCodes.MAX_CONCURRENT_STREAMS].append(2**31 - 1)
    client.remote_settings.acknowledge()
    return client, server


def test_a_stream_past_the_limit_is_refused_and_the_connection_serves_on() -> None:
    client, server = _over_limit_pair(2)
    held = []
    for _ in range(2):  # open, their requests not ended
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, GRPC_REQUEST)
        held.append(stream_id)
    refused = client.get_next_available_stream_id()
    # a header the HPACK table indexes on this block only: the refused stream's block must still be decoded,
    # or every later block that refers to that entry would decode wrong
    client.send_headers(refused, [*GRPC_REQUEST, ("x-first", "indexed")])
    client.send_data(refused, b"body", end_stream=False)
    events = server.receive_data(client.data_to_send())
    assert [type(e).__name__ for e in events] == ["RequestReceived", "RequestReceived", "StreamReset"]
    reset = events[-1]
    assert isinstance(reset, StreamReset)
    assert (reset.stream_id, reset.error_code, reset.remote_reset) == (
        refused, ErrorCodes.REFUSED_STREAM, False)
    answer = client.receive_data(server.data_to_send())
    assert [(type(e), e.stream_id, e.error_code) for e in answer if isinstance(e, StreamReset)] == [
        (StreamReset, refused, ErrorCodes.REFUSED_STREAM)]
    assert not any(isinstance(e, ConnectionTerminated) for e in answer)
    # the held streams end, and a new stream (reusing the indexed header) is received whole
    for stream_id in held:
        client.send_data(stream_id, b"", end_stream=True)
        server.send_headers(stream_id, RESPONSE, end_stream=True)
    client.receive_data(server.data_to_send())
    after = client.get_next_available_stream_id()
    client.send_headers(after, [*GRPC_REQUEST, ("x-first", "indexed")], end_stream=True)
    events = server.receive_data(client.data_to_send())
    requests = [e for e in events if isinstance(e, RequestReceived)]
    assert [e.stream_id for e in requests] == [after]
    assert (b"x-first", b"indexed") in requests[0].headers
    assert any(isinstance(e, StreamEnded) and e.stream_id == after for e in events)
    assert server.state_machine.state is not ConnectionState.CLOSED


def test_data_on_a_refused_stream_returns_its_connection_window() -> None:
    client, server = _over_limit_pair(1)
    client.send_headers(1, GRPC_REQUEST)
    client.send_headers(3, GRPC_REQUEST)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())  # (stream 3 refused: the client knows)
    window = server._inbound_flow_control_window_manager.current_window_size
    # DATA the client sent before it read the refusal: 48,000 bytes, most of the connection's window
    events = server.receive_data((bytes.fromhex("003e80" "00" "00" "00000003") + bytes(16_000)) * 3)
    assert not [e for e in events if isinstance(e, DataReceived)]
    updates = client.receive_data(server.data_to_send())
    assert server._inbound_flow_control_window_manager.current_window_size == window  # acknowledged at once
    assert any(isinstance(e, WindowUpdated) and e.stream_id == 0 for e in updates)
    assert server.state_machine.state is not ConnectionState.CLOSED


def test_stream_ids_stay_ordered_past_the_limit() -> None:
    # The refused stream's id is used: a later HEADERS with a lower id is h2's connection error, as always.
    client, server = _over_limit_pair(1)
    client.send_headers(1, GRPC_REQUEST)
    client.send_headers(5, GRPC_REQUEST)  # refused
    server.receive_data(client.data_to_send())
    assert server.highest_inbound_stream_id == 5
    block = Encoder().encode(GRPC_REQUEST)  # (a HEADERS frame the client's h2 would not send, by hand)
    with pytest.raises(ProtocolError):
        server.receive_data(struct.pack(">BHBBL", 0, len(block), 1, 0x5, 3) + block)
