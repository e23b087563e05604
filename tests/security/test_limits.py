"""Receive limits: oversized -> RESOURCE_EXHAUSTED (body never buffered); no message -> DEADLINE_EXCEEDED,
or INVALID_ARGUMENT once the stream ended without one."""

from __future__ import annotations

import logging

import grpc
import pytest
from engine_proto.engine.v1 import engine_service_pb2_grpc
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_proto.engine.v1.tokenize_pb2 import TokenizeRequest
from engine_server.api.security import SecurityConfig
from engine_server.api.transport.limits import MESSAGE_PREFIX
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from h2.events import ResponseReceived, TrailersReceived
from sec_fakes import WAIT_S, serve
from sec_raw_h2 import RawH2, grpc_frame, grpc_headers, raw_h2, text_headers

LIMIT = 64 * 1024


def _response_headers(raw: RawH2, stream_id: int) -> list[tuple[str, str]]:
    """The response headers and trailers the server sent on one stream, in order."""
    return [
        header
        for event in raw.events
        if isinstance(event, ResponseReceived | TrailersReceived) and event.stream_id == stream_id
        for header in text_headers(event)
    ]


def _request_of_size(num_bytes: int) -> TokenizeRequest:
    # field 1 (text) costs 1 tag byte + a varint length on top of the text
    overhead = TokenizeRequest(text="a" * num_bytes).ByteSize() - num_bytes
    request = TokenizeRequest(text="a" * (num_bytes - overhead))
    assert request.ByteSize() == num_bytes
    return request


async def test_oversized_message_is_resource_exhausted_and_server_keeps_serving() -> None:
    async with serve(SecurityConfig(max_receive_message_size=LIMIT)) as served:
        channel = Channel("127.0.0.1", served.port)
        try:
            stub = EngineServiceStub(channel)
            reply = await stub.Tokenize(_request_of_size(LIMIT), timeout=WAIT_S)  # exactly the limit: fine
            assert len(reply.token_ids) == 64
            for _ in range(3):  # repeatedly, on the same connection
                with pytest.raises(GRPCError) as err:
                    await stub.Tokenize(_request_of_size(LIMIT + 1), timeout=WAIT_S)
                assert err.value.status is Status.RESOURCE_EXHAUSTED
                assert err.value.message == f"received message larger than max ({LIMIT + 1} vs. {LIMIT})"
            # The connection's flow-control window was not leaked: many normal calls still fit.
            for _ in range(20):
                reply = await stub.Tokenize(TokenizeRequest(text="ok"), timeout=WAIT_S)
                assert list(reply.token_ids) == [ord("o"), ord("k")]
        finally:
            channel.close()


async def test_message_larger_than_flow_control_window() -> None:
    # 6 MiB > the 4 MiB stream window: the server must answer before the client could finish sending.
    size = 6 << 20
    async with (
        serve(SecurityConfig(max_receive_message_size=LIMIT)) as served,
        grpc.aio.insecure_channel(
            f"127.0.0.1:{served.port}", options=[("grpc.max_send_message_length", -1)]
        ) as channel,
    ):
        stub = engine_service_pb2_grpc.EngineServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Tokenize(TokenizeRequest(text="b" * size), timeout=WAIT_S)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        reply = await stub.Tokenize(TokenizeRequest(text="ok"), timeout=WAIT_S)
        assert list(reply.token_ids) == [ord("o"), ord("k")]


async def test_default_limit_is_4_mib() -> None:
    assert SecurityConfig().max_receive_message_size == 4 << 20
    async with serve(SecurityConfig()) as served:
        channel = Channel("127.0.0.1", served.port)
        try:
            with pytest.raises(GRPCError) as err:
                await EngineServiceStub(channel).Tokenize(_request_of_size((4 << 20) + 1), timeout=WAIT_S)
            assert err.value.status is Status.RESOURCE_EXHAUSTED
        finally:
            channel.close()


async def test_call_that_never_sends_its_message_times_out() -> None:
    async with serve(SecurityConfig(request_receive_timeout_s=0.2)) as served, raw_h2(served.port) as raw:
        stream_id = raw.conn.get_next_available_stream_id()
        raw.conn.send_headers(stream_id, grpc_headers(served.port, "/engine.v1.EngineService/Generate"))
        await raw.flush()  # headers only: the request message never comes
        await raw.wait_stream_done(stream_id)
        headers = _response_headers(raw, stream_id)
        assert ("grpc-status", str(Status.DEADLINE_EXCEEDED.value)) in headers
        assert ("grpc-message", "request message not received within 0.2 s") in headers
        assert served.engine.num_started == 0
        assert not raw.is_closed  # the connection itself is fine


async def _status_of_raw_call(port: int, path: str, body: bytes) -> tuple[str | None, str | None]:
    """(grpc-status, grpc-message) the server answers to one call whose DATA is `body`, sent as it is."""
    async with raw_h2(port) as raw:
        stream_id = raw.conn.get_next_available_stream_id()
        raw.conn.send_headers(stream_id, grpc_headers(port, path))
        raw.conn.send_data(stream_id, body, end_stream=True)
        await raw.flush()
        await raw.wait_stream_done(stream_id)
        headers = dict(_response_headers(raw, stream_id))
        return headers.get("grpc-status"), headers.get("grpc-message")


@pytest.mark.parametrize(
    ("method", "type_name"),
    [("Generate", "engine.v1.GenerateRequest"), ("Tokenize", "engine.v1.TokenizeRequest")],
    ids=["fast-path", "grpclib-path"],
)
async def test_malformed_message_is_invalid_argument(method: str, type_name: str) -> None:
    # 0x12 = field 2, length-delimited, and then no length: protobuf cannot parse it
    async with serve(SecurityConfig()) as served:
        status, message = await _status_of_raw_call(
            served.port, f"/engine.v1.EngineService/{method}", grpc_frame(b"\x12")
        )
        assert status == str(Status.INVALID_ARGUMENT.value)
        assert message is not None
        assert message.startswith(f"the request is not a valid {type_name}: ")
        assert served.engine.num_started == 0


async def test_message_cut_short_is_invalid_argument() -> None:
    async with serve(SecurityConfig()) as served:
        # the prefix announces 10 bytes, the stream ends after 3
        body = MESSAGE_PREFIX.pack(False, 10) + b"\x0a\x01a"
        status, message = await _status_of_raw_call(served.port, "/engine.v1.EngineService/Tokenize", body)
        assert status == str(Status.INVALID_ARGUMENT.value)
        assert message == "incomplete request message: the stream ended inside a 10-byte message"
        # and inside the prefix
        status, message = await _status_of_raw_call(
            served.port, "/engine.v1.EngineService/Tokenize", body[:3]
        )
        assert status == str(Status.INVALID_ARGUMENT.value)
        assert message == "incomplete request message: the stream ended inside a message's 5-byte prefix"


@pytest.mark.parametrize("path", ["/grpc.health.v1.Health/Check", "/engine.v1.EngineService/Tokenize"])
async def test_call_whose_stream_ends_without_its_message_is_invalid_argument(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    # grpclib hands a single-message method None for it: grpclib's own health Check (and our fake) asserted,
    # so the client got UNKNOWN and the log a traceback per call.
    async with serve(SecurityConfig()) as served, raw_h2(served.port) as raw:
        stream_id = raw.conn.get_next_available_stream_id()
        raw.conn.send_headers(stream_id, grpc_headers(served.port, path), end_stream=True)
        await raw.flush()
        await raw.wait_stream_done(stream_id)
        headers = _response_headers(raw, stream_id)
        assert ("grpc-status", str(Status.INVALID_ARGUMENT.value)) in headers
        assert ("grpc-message", "missing request message: the stream ended") in headers
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
