"""FastSender (the streaming hot path) delivers exactly what grpclib's send_message would, in order: small
messages, messages larger than a frame, more data than the flow-control window, with a listener present; its
constant header blocks decode to what grpclib sends and leave the HPACK tables alone."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from engine_proto.engine.v1 import generate_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_server.api.security import build_server
from engine_server.api.security.config import SecurityConfig
from engine_server.api.transport.fast_send import OK_TRAILERS_BLOCK, FastSender, initial_headers_block
from grpclib.client import Channel
from grpclib.const import Cardinality, Handler
from grpclib.events import SendInitialMetadata, SendMessage, SendTrailingMetadata, listen
from hpack import Decoder

TIMEOUT = 30.0
# (number of token ids) per message: small ones, one over h2's 16 KiB frame size, then enough to pass 1 MiB.
SIZES = [1, 3, 1, 9000, 2, *([500] * 400), 1]


def _response(i: int, size: int) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(request_id=f"m{i}")
    response.completions.add(index=0).token_ids.extend([i % 1000] * size)
    return response


class _StreamingService:
    def __init__(self) -> None:
        self.fast_paths: list[tuple[bool, bool, bool]] = []  # (messages, headers, trailers)
        self.connection: Any = None  # grpclib's server-side Connection

    async def generate(self, stream: Any) -> None:
        await stream.recv_message()
        self.connection = stream._stream.connection
        sender = FastSender(stream)
        await sender.send_initial_metadata()
        for i, size in enumerate(SIZES):
            await sender.send(_response(i, size))
        self.fast_paths.append((sender._ok, sender._headers_ok, sender.try_send_ok_trailers()))

    def __mapping__(self) -> dict[str, Handler]:
        return {"/engine.v1.EngineService/Generate": Handler(
            self.generate, Cardinality.UNARY_STREAM, generate_pb2.GenerateRequest,
            generate_pb2.GenerateResponse)}


def test_header_blocks_decode_to_grpclibs_headers_without_indexing() -> None:
    decoder = Decoder()
    initial = decoder.decode(initial_headers_block("application/grpc+proto"), raw=True)
    assert [tuple(h) for h in initial] == [(b":status", b"200"), (b"content-type", b"application/grpc+proto")]
    trailers = decoder.decode(OK_TRAILERS_BLOCK, raw=True)
    assert [tuple(h) for h in trailers] == [(b"grpc-status", b"0")]
    assert len(decoder.header_table.dynamic_entries) == 0  # the peer's table is unchanged


LISTENERS: list[Any] = [None, SendMessage, SendInitialMetadata, SendTrailingMetadata]


@pytest.mark.parametrize("listener", LISTENERS, ids=lambda event: getattr(event, "__name__", "none"))
async def test_fast_send_matches_the_protocol(listener: Any) -> None:
    service = _StreamingService()
    server = build_server([service], SecurityConfig())
    if listener is not None:
        async def on_event(event: Any) -> None:
            pass

        listen(server, listener, on_event)
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    channel = Channel("127.0.0.1", port)
    try:
        async with asyncio.timeout(TIMEOUT):
            stub = EngineServiceStub(channel)
            for _ in range(3):  # calls on one connection: windows and HPACK tables stay right across calls
                async with stub.Generate.open() as stream:
                    await stream.send_message(generate_pb2.GenerateRequest(), end=True)
                    await stream.recv_initial_metadata()
                    received = [response async for response in stream]
                    await stream.recv_trailing_metadata()
                assert stream.initial_metadata == {}  # grpclib's client rejects a bad content-type itself
                assert stream.trailing_metadata == {}
                assert [r.request_id for r in received] == [f"m{i}" for i in range(len(SIZES))]
                assert [len(r.completions[0].token_ids) for r in received] == SIZES
                assert all(set(r.completions[0].token_ids) == {i % 1000} for i, r in enumerate(received))
        # grpclib's per-connection books (and the guard's, through data_send_process) are kept either way
        # (the fast path keeps them once per loop tick): three calls' messages and bytes (prefix included).
        sizes = [5 + len(_response(i, size).SerializeToString()) for i, size in enumerate(SIZES)]
        connection = service.connection
        assert (connection.messages_sent, connection.data_sent) == (3 * len(SIZES), 3 * sum(sizes))
        assert connection.last_data_sent is not None
        guard = connection._transport.get_protocol()  # api/transport/h2_guard.py: every frame sent is counted
        assert guard._num_sends >= 3 * (len(SIZES) + 2)  # DATA frames, and headers + trailers per call
        assert connection.last_message_sent >= connection.last_data_sent
        fast = listener is None
        expected = (fast or listener is not SendMessage, fast or listener is SendTrailingMetadata,
                    fast or listener is SendInitialMetadata)
        assert service.fast_paths == [expected] * 3
    finally:
        channel.close()
        server.close()
        await asyncio.wait_for(server.wait_closed(), TIMEOUT)


def test_headers_marked_by_hand_leave_h2s_stream_as_h2_would() -> None:
    from engine_server.api.transport.fast_send import mark_headers_sent
    from h2.config import H2Configuration
    from h2.connection import H2Connection
    from h2.stream import StreamInputs

    def server_stream() -> Any:
        client = H2Connection(H2Configuration(client_side=True))
        client.initiate_connection()
        client.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":path", "/x"),
                                (":authority", "a")], end_stream=True)
        server = H2Connection(H2Configuration(client_side=False))
        server.initiate_connection()
        server.receive_data(client.data_to_send())
        return server.streams[1].state_machine

    def seen(machine: Any) -> tuple[Any, ...]:
        return (machine.state, machine.headers_sent, machine.trailers_sent, machine.stream_closed_by)

    by_hand, by_h2 = server_stream(), server_stream()
    for end_stream in (False, True):  # the response headers, then the trailers
        assert mark_headers_sent(by_hand, end_stream=end_stream)
        by_h2.process_input(StreamInputs.SEND_HEADERS)
        if end_stream:
            by_h2.process_input(StreamInputs.SEND_END_STREAM)
        assert seen(by_hand) == seen(by_h2)
    assert not mark_headers_sent(by_hand, end_stream=True)  # closed: h2 would refuse; nothing changes
    assert seen(by_hand) == seen(by_h2)
