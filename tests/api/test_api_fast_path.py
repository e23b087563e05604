"""api/transport/fast_path.py: a buffered Generate call is served by the fast path with the results, errors,
metrics, API-key check, deadline and cancellation of grpclib's request_handler; anything else goes to it."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import apiutil
import pytest
from apiutil import CALL_TIMEOUT_S, completion_ids, greedy_request
from engine_server.api.config import ServerConfig
from engine_server.api.handle import EngineHandle
from engine_server.api.security.config import SecurityConfig
from engine_server.api.server import EngineServer
from engine_server.api.transport.guarded_server import _grpclib_handler
from engine_server.engine.config import EngineConfig
from fakes import FakeEngine
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, ResponseReceived, TrailersReceived

API_KEY = "fast-path-test-key-0123456789"
GENERATE = "/engine.v1.EngineService/Generate"


class Harness(apiutil.Harness):
    @property
    def num_fast(self) -> int:
        return self.server._server.guard_stats.num_fast_path_calls

    def count(self, code: str) -> float:
        metrics = self.server.metrics
        assert metrics is not None
        sample: Callable[[str, dict[str, str]], Any] = metrics.registry.get_sample_value
        return sample("engine_requests_total", {"rpc": "Generate", "code": code}) or 0.0


async def _harness(*, api_key: str | None = None, max_size: int = 4 << 20, fast: bool = True) -> Harness:
    engine = FakeEngine()
    engine.gate.set()

    async def start_engine() -> EngineHandle:
        return engine

    security = SecurityConfig(api_key=api_key, max_receive_message_size=max_size)
    config = ServerConfig(port=0, metrics_port=0, drain_timeout_s=5.0, security=security)
    server = EngineServer(config, engine_config=EngineConfig(model="/fake/model"), start_engine=start_engine)
    if not fast:  # grpclib's request_handler for every call: the reference
        server._server._handler_factory = _grpclib_handler
    await server.start()
    return Harness(server, engine)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = await _harness()
    yield h
    h.channel.close()
    await h.server.close()


async def _until_fast(call: Callable[[], Any], harness: Harness, *, tries: int = 10) -> Any:
    """`call()` until one took the fast path (a client may send its DATA after the HEADERS were dispatched:
    that call rightly takes grpclib's path)."""
    before = harness.num_fast
    for _ in range(tries):
        result = await call()
        if harness.num_fast > before:
            return result
    raise AssertionError(f"no fast-path call in {tries} tries")


async def test_fast_and_grpclib_paths_give_the_same_responses_and_metrics(harness: Harness) -> None:
    reference = await _harness(fast=False)
    try:
        for stream in (True, False):
            for timeout in (None, CALL_TIMEOUT_S):
                request = greedy_request([5, 6], max_tokens=3, stream=stream, request_id=f"same-{stream}")
                fast = await _until_fast(
                    lambda request=request, timeout=timeout: harness.stub.Generate(  # type: ignore[misc]
                        request, timeout=timeout), harness)
                slow = await reference.stub.Generate(request, timeout=timeout)
                assert [m.SerializeToString() for m in fast] == [m.SerializeToString() for m in slow]
                assert completion_ids(fast) == [7, 8, 9]
        assert reference.num_fast == 0
        assert harness.count("OK") == reference.count("OK") == 4  # the fast calls were counted too
    finally:
        reference.channel.close()
        await reference.server.close()


async def test_errors_are_the_same_on_both_paths(harness: Harness) -> None:
    reference = await _harness(fast=False)
    try:
        statuses = []
        for h in (harness, reference):
            with pytest.raises(GRPCError) as caught:
                await h.stub.Generate(greedy_request([10_000]))  # outside the vocabulary
            statuses.append((caught.value.status, caught.value.message))
            assert h.count("INVALID_ARGUMENT") == 1
        assert statuses[0] == statuses[1]
        assert statuses[0][0] == Status.INVALID_ARGUMENT
    finally:
        reference.channel.close()
        await reference.server.close()


async def _raw_call(port: int, request: bytes, extra_headers: list[tuple[str, str]]) -> dict[str, str]:
    """One Generate call over plain h2 (HEADERS and DATA in one write; headers a grpclib client cannot set,
    and no client-side deadline racing the server's); returns the trailers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client = H2Connection(H2Configuration(client_side=True, header_encoding="ascii"))
    client.initiate_connection()
    client.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":path", GENERATE),
                            (":authority", "test"), ("content-type", "application/grpc"), ("te", "trailers"),
                            *extra_headers])
    client.send_data(1, struct.pack(">BI", 0, len(request)) + request, end_stream=True)
    writer.write(client.data_to_send())
    trailers: dict[str, str] = {}
    try:
        while "grpc-status" not in trailers:
            data = await asyncio.wait_for(reader.read(65536), CALL_TIMEOUT_S)
            assert data, "connection closed before the trailers"
            for event in client.receive_data(data):
                if isinstance(event, (ResponseReceived, TrailersReceived)):
                    trailers.update((str(name), str(value)) for name, value in event.headers)
                elif isinstance(event, DataReceived):
                    client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            writer.write(client.data_to_send())
    finally:
        writer.close()
    return trailers


async def test_a_passed_deadline_on_the_fast_path_is_deadline_exceeded_and_aborts(harness: Harness) -> None:
    reference = await _harness(fast=False)
    try:
        request = greedy_request([5], max_tokens=10).SerializeToString()
        counts = []
        for h in (harness, reference):
            h.engine.gate.clear()  # the stream stalls after its first message: the deadline passes
            trailers = await _raw_call(h.server.port, request, [("grpc-timeout", "300m")])
            assert trailers["grpc-status"] == str(Status.DEADLINE_EXCEEDED.value)
            for _ in range(100):
                if h.engine.num_cancelled:
                    break
                await asyncio.sleep(0.01)
            assert h.engine.num_cancelled == 1
            assert not h.engine.in_flight
            counts.append({code: h.count(code) for code in ("OK", "CANCELLED", "DEADLINE_EXCEEDED")})
        assert harness.num_fast == 1
        assert reference.num_fast == 0
        assert counts[0] == counts[1]
        assert counts[0]["DEADLINE_EXCEEDED"] == 1  # the deadline's cancellation is counted as what it is
        assert counts[0]["CANCELLED"] == 0
    finally:
        reference.channel.close()
        await reference.server.close()


@pytest.mark.parametrize("stream", [True, False])  # a direct call, and one on the fast path's task
async def test_a_malformed_deadline_is_invalid_argument(harness: Harness, stream: bool) -> None:
    # grpclib answered UNKNOWN ("Invalid grpc-timeout header") and took any number of digits; gRPC's
    # PROTOCOL-HTTP2.md allows at most 8. Never started: the engine sees nothing.
    before, num_requests = harness.num_fast, len(harness.engine.requests)
    request = greedy_request([5], max_tokens=2, stream=stream).SerializeToString()
    for value in ("soon", "1x", "abc", "99999999999S", "-1S", "1.5S", "1s"):
        trailers = await _raw_call(harness.server.port, request, [("grpc-timeout", value)])
        assert trailers["grpc-status"] == str(Status.INVALID_ARGUMENT.value), value
        assert trailers["grpc-message"] == (
            f"malformed grpc-timeout {value!r}: expected 1 to 8 digits and a unit (H, M, S, m, u or n)")
    assert harness.num_fast == before
    assert harness.count("INVALID_ARGUMENT") == 7  # counted as what it is
    assert len(harness.engine.requests) == num_requests
    # at most 8 digits is well-formed
    trailers = await _raw_call(harness.server.port, request, [("grpc-timeout", "99999999S")])
    assert trailers["grpc-status"] == str(Status.OK.value)


async def test_an_oversized_request_takes_grpclibs_path_and_is_refused() -> None:
    h = await _harness(max_size=64)
    try:
        before = h.num_fast
        with pytest.raises(GRPCError) as caught:
            await h.stub.Generate(greedy_request(list(range(5, 200))))
        assert caught.value.status == Status.RESOURCE_EXHAUSTED
        assert h.num_fast == before
        small = greedy_request([5], max_tokens=1)
        await _until_fast(lambda: h.stub.Generate(small), h)  # small requests still take it
    finally:
        h.channel.close()
        await h.server.close()


async def test_the_api_key_is_checked_on_the_fast_path() -> None:
    h = await _harness(api_key=API_KEY)
    try:
        request = greedy_request([5], max_tokens=2)
        good = {"authorization": f"Bearer {API_KEY}"}
        responses = await _until_fast(lambda: h.stub.Generate(request, metadata=good), h)
        assert completion_ids(responses) == [6, 7]
        before = h.num_fast
        for metadata in ({}, {"authorization": "Bearer wrong"}):
            with pytest.raises(GRPCError) as caught:
                await h.stub.Generate(request, metadata=metadata)
            assert caught.value.status == Status.UNAUTHENTICATED
        assert h.num_fast > before  # refused on the fast path, not by falling back
        assert h.count("UNAUTHENTICATED") == 2
    finally:
        h.channel.close()
        await h.server.close()


async def test_a_cancelled_fast_call_aborts_the_engine_request(harness: Harness) -> None:
    for _ in range(10):
        harness.engine.gate.clear()
        before_fast, before_cancelled = harness.num_fast, harness.engine.num_cancelled
        async with harness.stub.Generate.open() as call:
            await call.send_message(greedy_request([5], max_tokens=10), end=True)
            assert await call.recv_message() is not None
            await call.cancel()
        for _ in range(100):  # the RST_STREAM reaches the handler asynchronously
            if harness.engine.num_cancelled > before_cancelled:
                break
            await asyncio.sleep(0.01)
        assert harness.engine.num_cancelled == before_cancelled + 1
        assert not harness.engine.in_flight
        if harness.num_fast > before_fast:
            return
    raise AssertionError("no cancelled call took the fast path")


async def test_only_registered_methods_take_the_fast_path(harness: Harness) -> None:
    from engine_proto.engine.v1 import info_pb2

    before = harness.num_fast
    for _ in range(3):
        await harness.stub.GetLoad(info_pb2.GetLoadRequest())
    assert harness.num_fast == before



def _buffered(*frames: bytes, end: bool = True, max_size: int = 100,
              lean: bool = False) -> tuple[bytes | None, list[int], Any]:
    from types import SimpleNamespace

    from engine_server.api.transport.call_streams import LeanBuffer
    from engine_server.api.transport.fast_path import _buffered_request
    from grpclib.const import Cardinality
    from grpclib.protocol import Buffer

    acked: list[int] = []
    buffer = LeanBuffer(acked.append) if lean else Buffer(acked.append)
    for frame in frames:
        buffer.add(frame, len(frame))
    if end:
        buffer.eof()
    stream = SimpleNamespace(buffer=buffer)
    method = SimpleNamespace(cardinality=Cardinality.UNARY_STREAM)
    return _buffered_request(stream, method, max_size), acked, buffer


@pytest.mark.parametrize("lean", [False, True])
def test_the_buffered_request_is_taken_only_when_complete_and_well_formed(lean: bool) -> None:
    message = b"\x00\x00\x00\x00\x03abc"
    assert _buffered(message, lean=lean)[:2] == (b"abc", [8])
    assert _buffered(message[:4], message[4:], lean=lean)[:2] == (b"abc", [4, 4])  # over two DATA frames
    for frames, end, max_size in [
        ((message,), False, 100),  # the client has not ended the stream: it may still be sending
        ((message[:6],), True, 100),  # shorter than its prefix says
        ((message + message,), True, 100),  # two messages on a unary request
        ((b"\x01" + message[1:],), True, 100),  # compressed
        ((message,), True, 2),  # over the size limit
        ((), True, 100),  # no message at all
    ]:
        taken, acked, buffer = _buffered(*frames, end=end, max_size=max_size, lean=lean)
        assert taken is None
        assert acked == []  # left for grpclib's path, which reads (and refuses) it as before
        assert buffer._unacked.qsize() == len(frames) + end


async def test_a_malformed_request_fails_as_on_grpclibs_path(harness: Harness) -> None:
    reference = await _harness(fast=False)
    try:
        results = []
        for h in (harness, reference):
            trailers = await _raw_call(h.server.port, b"\xff\xff\xff", [])  # not a GenerateRequest
            status = trailers["grpc-status"]
            results.append((status, trailers.get("grpc-message"), h.count("INVALID_ARGUMENT")))
        assert results[0] == results[1]
        assert results[0][0] == str(Status.INVALID_ARGUMENT.value)
        assert (results[0][1] or "").startswith("the request is not a valid engine.v1.GenerateRequest: ")
        assert results[0][2] == 1  # counted by the metrics wrapper on both paths
        assert harness.num_fast == 1
    finally:
        reference.channel.close()
        await reference.server.close()
