"""Canary: the grpclib (0.4.x) and h2 internals the security layer hooks into. An upgrade that fails here
needs api/security/{h2_guard,limits,goaway}.py (and api/{h2_streams,fast_path,fast_send}.py) revisited before
anything else."""

from __future__ import annotations

import inspect
from collections import deque

import grpclib.protocol
import grpclib.server
import hpack
import pytest
from grpclib.protocol import Connection, EventsProcessor, H2Protocol
from grpclib.stream import recv_message
from h2.config import H2Configuration
from h2.connection import ConnectionState, H2Connection
from h2.events import ConnectionTerminated
from h2.exceptions import TooManyStreamsError
from h2.settings import SettingCodes, Settings
from h2.stream import H2Stream
from hyperframe.frame import HeadersFrame


def test_hooks_exist() -> None:
    # h2_guard: the protocol factory, the processor's dispatch table and per-connection hooks.
    assert callable(grpclib.server.Server._protocol_factory)
    for name in ("process_stream_reset", "process", "close", "register"):
        assert callable(getattr(EventsProcessor, name))
    for name in ("headers_send_process", "data_send_process", "feed", "flush", "ack"):
        assert callable(getattr(Connection, name))
    assert "self._connection = connection" in inspect.getsource(Connection.__init__)
    assert "self._tasks" in inspect.getsource(grpclib.server.Handler.__init__)
    # fast_path: FastPathHandler sets how often grpclib drops finished call tasks through this attribute.
    assert "self.__gc_interval__" in inspect.getsource(grpclib.server._GC.__gc_step__)
    assert "self.__gc_step__()" in inspect.getsource(grpclib.server.Handler.accept)
    assert "self.processor = EventsProcessor" in inspect.getsource(H2Protocol.connection_made)
    # limits: grpclib.server.Stream.recv_message is what we replace per call; it must still read the
    # 5-byte prefix through grpclib.stream.recv_message with these attributes.
    source = inspect.getsource(grpclib.server.Stream.recv_message)
    assert "recv_message(self._stream, self._codec, self._recv_type)" in source
    assert "self._dispatch.recv_message" in source
    assert "recv_data(5)" in inspect.getsource(recv_message)


def test_h2_settings_internals() -> None:
    # h2_guard makes its MAX_CONCURRENT_STREAMS effective before the peer's ACK through Settings._settings.
    settings = Settings(client=False, initial_values={SettingCodes.MAX_CONCURRENT_STREAMS: 7})
    assert list(settings._settings[SettingCodes.MAX_CONCURRENT_STREAMS]) == [7]


def test_drain_internals() -> None:
    # h2_guard's drain counts open streams through the release callable `register` returns, which grpclib's
    # request handler calls once its stream is done.
    assert "return release_stream" in inspect.getsource(EventsProcessor.register)
    assert "release_stream()" in inspect.getsource(grpclib.server.request_handler)
    # goaway.py: grpclib's client ends every open stream on any GOAWAY (hence no early GOAWAY for it, and the
    # linger). A grpclib that stops doing so could get the early GOAWAY too.
    assert "self.close(" in inspect.getsource(EventsProcessor.process_connection_terminated)


def test_h2_goaway_names_the_last_stream_the_client_opened() -> None:
    # The final drain GOAWAY relies on close_connection's default last_stream_id.
    client = H2Connection(H2Configuration(client_side=True))
    client.initiate_connection()
    server = H2Connection(H2Configuration(client_side=False))
    server.initiate_connection()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", "/x"), (":authority", "a")]
    for stream_id in (1, 3):
        client.send_headers(stream_id, headers, end_stream=True)
    server.receive_data(client.data_to_send())
    server.close_connection()
    events = client.receive_data(server.data_to_send())
    (goaway,) = [e for e in events if isinstance(e, ConnectionTerminated)]
    assert goaway.last_stream_id == 3


def test_fast_path_internals() -> None:
    # api/fast_send.py: h2 queues its own frames in _data_to_send (checked before data_to_send() is called);
    # api/security/limits.py: the stream buffer's _eof says the client half-closed (nothing more to wait for);
    # api/h2_streams.py: h2 counts open streams through _open_streams(remainder), creates streams in
    # _begin_new_stream, runs received headers through the stream's _process_received_headers, and HPACK's
    # decoder changes its table only through HeaderTable.add and the maxsize setter.
    connection = H2Connection(H2Configuration(client_side=False))
    connection.initiate_connection()
    assert connection._data_to_send
    assert connection.data_to_send()
    assert not connection._data_to_send
    assert "self._eof = True" in inspect.getsource(grpclib.protocol.Buffer.eof)
    # api/fast_send.py: a written DATA frame stamps last_message_sent with the time data_send_process took
    assert "self.last_data_sent = time.monotonic()" in inspect.getsource(Connection.data_send_process)
    assert "_open_streams(inbound_numbers)" in inspect.getsource(H2Connection)
    assert "self._begin_new_stream(" in inspect.getsource(H2Connection._get_or_create_stream)
    assert "self._process_received_headers(" in inspect.getsource(H2Stream.receive_headers)
    decoder_source = inspect.getsource(hpack.Decoder)
    assert "self.header_table.add(" in decoder_source
    assert "dynamic_entries" not in decoder_source


def test_h2_refuses_a_stream_past_the_limit_before_anything_changed() -> None:
    # api/h2_streams.py refuses such a stream alone by catching h2's TooManyStreamsError from the HEADERS
    # frame's handler (which it puts in the connection's frame dispatch table) and opening the stream again:
    # h2 must raise before it decoded the block (the HPACK table), counted the frame or made the stream.
    server = H2Connection(H2Configuration(client_side=False))
    server.initiate_connection()
    server.local_settings._settings[SettingCodes.MAX_CONCURRENT_STREAMS] = deque([1])
    assert server._frame_dispatch_table[HeadersFrame] == server._receive_headers_frame
    encoder = hpack.Encoder()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", "/x"), (":authority", "a"), ("x-new", "1")]
    server.receive_data(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _headers_frame(1, encoder.encode(headers)))
    table_size = len(server.decoder.header_table.dynamic_entries)
    second = HeadersFrame(3)
    second.data = encoder.encode([*headers, ("x-second", "2")])
    second.flags.add("END_HEADERS")
    with pytest.raises(TooManyStreamsError):
        server._receive_headers_frame(second)
    assert len(server.decoder.header_table.dynamic_entries) == table_size
    assert 3 not in server.streams
    assert server.highest_inbound_stream_id == 1
    assert server.state_machine.state is ConnectionState.SERVER_OPEN


def _headers_frame(stream_id: int, block: bytes) -> bytes:
    frame = HeadersFrame(stream_id)
    frame.data = block
    frame.flags.add("END_HEADERS")
    return frame.serialize()
