"""Canary: the grpclib (0.4.x) and h2 internals the security layer hooks into. An upgrade that fails here
needs api/security/{h2_guard,limits}.py revisited before anything else."""

from __future__ import annotations

import inspect

import grpclib.server
from grpclib.protocol import Connection, EventsProcessor, H2Protocol
from grpclib.stream import recv_message
from h2.settings import SettingCodes, Settings


def test_hooks_exist() -> None:
    # h2_guard: the protocol factory, the processor's dispatch table and per-connection hooks.
    assert callable(grpclib.server.Server._protocol_factory)
    for name in ("process_stream_reset", "process", "close", "register"):
        assert callable(getattr(EventsProcessor, name))
    for name in ("headers_send_process", "data_send_process", "feed", "flush", "ack"):
        assert callable(getattr(Connection, name))
    assert "self._connection = connection" in inspect.getsource(Connection.__init__)
    assert "self._tasks" in inspect.getsource(grpclib.server.Handler.__init__)
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
