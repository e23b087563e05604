"""The guard's protocol fed byte by byte, without sockets: deterministic ordering of reads and task steps."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import pytest
from engine_proto.engine.v1 import generate_pb2
from engine_server.api.security import H2Policy, SecurityConfig, build_server
from engine_server.api.security.budget import GuardStats, TokenBucket
from engine_server.api.security.metrics import register_guard_metrics
from engine_server.api.transport.fast_path import DirectCall, DirectStart, FastPathHandler
from engine_server.api.transport.guarded_server import GuardedServer
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.health.service import Health
from grpclib.metadata import decode_grpc_message
from grpclib.protocol import H2Protocol
from grpclib.server import Server, Stream
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import RemoteSettingsChanged, ResponseReceived, StreamReset, TrailersReceived
from prometheus_client import CollectorRegistry
from sec_fakes import WAIT_S, FakeEngine, FakeEngineService
from sec_raw_h2 import grpc_frame, grpc_headers, text_headers

GENERATE = "/engine.v1.EngineService/Generate"
TOKENIZE = "/engine.v1.EngineService/Tokenize"
# the fast path's task, grpclib's request_handler, grpclib's own service
CALLED_PATHS = (GENERATE, TOKENIZE, "/grpc.health.v1.Health/Check")
MESSAGE = grpc_frame(generate_pb2.GenerateRequest(request_id="u").SerializeToString())


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self._is_closing = False

    def write(self, data: Any) -> None:
        self.written.extend(data)

    def is_closing(self) -> bool:
        return self._is_closing

    def close(self) -> None:
        self._is_closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class Peer:
    """The client side: an h2 state machine whose bytes we hand to the server protocol ourselves."""

    def __init__(self, protocol: H2Protocol) -> None:
        self.protocol = protocol
        self.transport = FakeTransport()
        protocol.connection_made(self.transport)
        self.conn = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.send()
        self.conn.receive_data(bytes(self.transport.written))  # server preface and SETTINGS
        self.transport.written.clear()
        self.send()  # SETTINGS ACK

    def send(self) -> None:
        self.protocol.data_received(self.conn.data_to_send())

    def open(self, num_streams: int) -> list[int]:
        stream_ids = []
        for _ in range(num_streams):
            stream_id = self.conn.get_next_available_stream_id()
            self.conn.send_headers(stream_id, grpc_headers(1, GENERATE))
            self.conn.send_data(stream_id, MESSAGE, end_stream=True)
            stream_ids.append(stream_id)
        self.send()
        return stream_ids

    def call_each(self, paths: tuple[str, ...], metadata: list[tuple[str, str]]) -> list[int]:
        """One call per path, each with the metadata and an empty message."""
        stream_ids = []
        for path in paths:
            stream_id = self.conn.get_next_available_stream_id()
            self.conn.send_headers(stream_id, [*grpc_headers(1, path), *metadata])
            self.conn.send_data(stream_id, grpc_frame(b""), end_stream=True)
            stream_ids.append(stream_id)
        self.send()
        return stream_ids

    def reset(self, stream_ids: list[int]) -> None:
        for stream_id in stream_ids:
            self.conn.reset_stream(stream_id, error_code=ErrorCodes.CANCEL)
        self.send()

    def received_resets(self) -> dict[int, int]:
        events = self.conn.receive_data(bytes(self.transport.written))
        self.transport.written.clear()
        return {e.stream_id: e.error_code for e in events if isinstance(e, StreamReset)}


def _statuses(peer: Peer) -> dict[int, str | None]:
    """The grpc-status of each stream the server answered, from what it wrote."""
    events = peer.conn.receive_data(bytes(peer.transport.written))
    peer.transport.written.clear()
    return {e.stream_id: dict(text_headers(e)).get("grpc-status")
            for e in events if isinstance(e, ResponseReceived | TrailersReceived)}


def _answers(peer: Peer) -> dict[int, dict[str, str]]:
    """The response headers and trailers of each stream the server answered, from what it wrote (the
    grpc-message percent-decoded)."""
    events = peer.conn.receive_data(bytes(peer.transport.written))
    peer.transport.written.clear()
    answers: dict[int, dict[str, str]] = {}
    for event in events:
        if isinstance(event, ResponseReceived | TrailersReceived):
            answers.setdefault(event.stream_id, {}).update(text_headers(event))
    for answer in answers.values():
        if "grpc-message" in answer:
            answer["grpc-message"] = decode_grpc_message(answer["grpc-message"])
    return answers


async def _settle(protocol: H2Protocol) -> None:
    # Wait (bounded) until every handler task of the connection is done, then let done-callbacks run.
    handler: Any = protocol.handler
    tasks = set(handler._tasks.values()) | set(handler._cancelled)
    if tasks:
        await asyncio.wait(tasks, timeout=WAIT_S)
    await asyncio.sleep(0)


async def test_streams_reset_before_their_handler_ran_are_released() -> None:
    # grpclib alone leaks them: a task cancelled before its first step never runs the `finally` that
    # releases its stream (and acknowledges its unread DATA), so they pile up until the connection closes.
    for server_cls, expected_leak in ((Server, 10), (GuardedServer, 0)):
        engine = FakeEngine()
        server = server_cls([FakeEngineService(engine)])
        peer = Peer(server._protocol_factory())
        stream_ids = peer.open(10)  # one read: handler tasks created, not started
        peer.reset(stream_ids)  # the next read, before the loop ran them
        await _settle(peer.protocol)
        assert len(peer.protocol.processor.streams) == expected_leak, server_cls
        assert engine.num_started == 0


async def test_unwinding_handlers_count_towards_the_stream_limit() -> None:
    server = GuardedServer([FakeEngineService(FakeEngine())], policy=H2Policy(max_concurrent_streams=4))
    peer = Peer(server._protocol_factory())
    first = peer.open(4)
    peer.reset(first)
    second = peer.open(4)  # h2 sees 0 open streams, but 8 handlers have not finished yet
    peer.reset(second)
    refused = peer.open(2)
    assert server.guard_stats.num_refused_streams == 2
    assert peer.received_resets() == dict.fromkeys(refused, ErrorCodes.REFUSED_STREAM)
    await _settle(peer.protocol)
    assert not peer.protocol.processor.streams
    accepted = peer.open(1)  # once they unwound, new streams are accepted again
    assert list(peer.protocol.processor.streams) == accepted
    assert server.guard_stats.num_refused_streams == 2
    peer.protocol.connection_lost(None)
    await _settle(peer.protocol)


async def test_opened_and_reset_in_one_read_is_never_dispatched() -> None:
    engine = FakeEngine()
    server = GuardedServer([FakeEngineService(engine)])
    peer = Peer(server._protocol_factory())
    for _ in range(5):
        stream_id = peer.conn.get_next_available_stream_id()
        peer.conn.send_headers(stream_id, grpc_headers(1, GENERATE))
        peer.conn.send_data(stream_id, MESSAGE, end_stream=True)
        peer.conn.reset_stream(stream_id, error_code=ErrorCodes.CANCEL)
    peer.send()
    assert server.guard_stats.num_dropped_streams == 5
    assert not peer.protocol.processor.streams
    assert not peer.protocol.handler._tasks  # type: ignore[attr-defined]
    await _settle(peer.protocol)
    assert engine.num_started == 0


def test_token_bucket_refills_up_to_burst() -> None:
    bucket = TokenBucket(burst=3, rate_per_s=10.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(0.1)  # one token back after 0.1 s
    assert not bucket.take(0.1)
    assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]  # never above the burst
    bucket.credit(2)
    assert [bucket.take(100.0) for _ in range(3)] == [True, True, False]


def test_guard_stats_are_exported_to_prometheus() -> None:
    stats = GuardStats()
    registry = CollectorRegistry()
    register_guard_metrics(registry, stats)
    stats.count_goaway("rapid_reset")
    stats.count_goaway("rapid_reset")
    stats.num_dropped_streams = 7
    stats.num_fast_path_calls = 3
    assert registry.get_sample_value("engine_http2_goaways_total", {"reason": "rapid_reset"}) == 2
    assert registry.get_sample_value("engine_grpc_fast_path_calls_total") == 3
    assert registry.get_sample_value("engine_http2_dropped_streams_total") == 7
    assert registry.get_sample_value("engine_http2_refused_streams_total") == 0


async def test_stream_limit_applies_from_the_first_byte() -> None:
    # A client may open streams before it has read our SETTINGS; h2 alone would enforce its own default of
    # 100 until our SETTINGS are acknowledged and fail the whole connection at the 101st stream.
    engine = FakeEngine()
    server = GuardedServer([FakeEngineService(engine)], policy=H2Policy(max_concurrent_streams=300))
    protocol = server._protocol_factory()
    transport = FakeTransport()
    protocol.connection_made(transport)
    client = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
    client.initiate_connection()
    for _ in range(150):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, grpc_headers(1, GENERATE))
        client.send_data(stream_id, MESSAGE, end_stream=True)
    protocol.data_received(client.data_to_send())  # preface, SETTINGS and 150 calls in one read
    assert not transport.is_closing()
    assert len(protocol.processor.streams) == 150
    events = client.receive_data(bytes(transport.written))
    settings = [e for e in events if isinstance(e, RemoteSettingsChanged)]
    assert client.remote_settings.max_concurrent_streams == 300
    assert settings
    protocol.connection_lost(None)
    await _settle(protocol)


async def test_a_request_without_method_or_path_is_reset_as_malformed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # grpclib turns h2's header validation off and its request_handler reads :method and :path unchecked:
    # without them, KeyError, "Server error" with a traceback in the log, and a stream never answered.
    engine = FakeEngine()
    server = GuardedServer([FakeEngineService(engine)])
    peer = Peer(server._protocol_factory())
    peer.conn.config.validate_outbound_headers = False
    headers = grpc_headers(1, GENERATE)
    malformed = [[h for h in headers if h[0] != name] for name in (":method", ":path")]
    stream_ids = []
    for request_headers in malformed:
        stream_id = peer.conn.get_next_available_stream_id()
        peer.conn.send_headers(stream_id, request_headers)
        peer.conn.send_data(stream_id, MESSAGE, end_stream=True)
        stream_ids.append(stream_id)
    peer.send()
    assert peer.received_resets() == dict.fromkeys(stream_ids, ErrorCodes.PROTOCOL_ERROR)
    assert not peer.protocol.processor.streams
    assert not peer.protocol.handler._tasks  # type: ignore[attr-defined]
    (valid,) = peer.open(1)  # the connection serves on
    await engine.wait_for(lambda: engine.num_started == 1)
    assert valid not in peer.received_resets()
    peer.protocol.connection_lost(None)
    await _settle(peer.protocol)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def _never_started(started: list[Stream[Any, Any]]) -> DirectStart:
    def start(call: Stream[Any, Any], body: bytes, direct: DirectCall) -> bool:
        started.append(call)
        return False
    return start


# build_server's own handler, and the fast path (Generate's direct start, recording whether it ran)
_HANDLERS = pytest.mark.parametrize("handler", ["default", "fast path"])


def _handler_factory(handler: str, started: list[Stream[Any, Any]]) -> dict[str, Any]:
    if handler == "default":
        return {}
    direct = {GENERATE: _never_started(started)}
    return {"handler_factory": functools.partial(FastPathHandler, fast_methods=(GENERATE,), direct=direct)}


@_HANDLERS
async def test_a_call_whose_deadline_passed_on_arrival_is_deadline_exceeded(
    caplog: pytest.LogCaptureFixture, handler: str
) -> None:
    # grpclib's DeadlineWrapper raises TimeoutError when started on a deadline already passed, before it
    # counts as cancelled: "Timeout occurred" with a traceback in the log, and UNKNOWN for the client.
    # Nothing is started for such a call: neither the direct start nor the engine request.
    engine = FakeEngine()
    started: list[Stream[Any, Any]] = []
    server = build_server([FakeEngineService(engine), Health()], SecurityConfig(),
                          **_handler_factory(handler, started))
    peer = Peer(server._protocol_factory())
    stream_ids = peer.call_each(CALLED_PATHS, [("grpc-timeout", "1n")])
    await _settle(peer.protocol)
    assert _statuses(peer) == dict.fromkeys(stream_ids, str(Status.DEADLINE_EXCEEDED.value))
    assert started == []
    assert engine.num_started == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    peer.protocol.connection_lost(None)
    await _settle(peer.protocol)


@_HANDLERS
@pytest.mark.parametrize("value", ["1x", "abc", "99999999999S", ""])
async def test_a_malformed_grpc_timeout_is_invalid_argument_on_every_path(
    caplog: pytest.LogCaptureFixture, handler: str, value: str
) -> None:
    # grpclib's request_handler answered UNKNOWN ("Invalid grpc-timeout header") and took a value of any
    # number of digits (gRPC allows 8). Nothing is started for such a call.
    engine = FakeEngine()
    started: list[Stream[Any, Any]] = []
    server = build_server([FakeEngineService(engine), Health()], SecurityConfig(),
                          **_handler_factory(handler, started))
    peer = Peer(server._protocol_factory())
    stream_ids = peer.call_each(CALLED_PATHS, [("grpc-timeout", value)])
    await asyncio.sleep(0)  # (a direct call's first step: a loop callback)
    await _settle(peer.protocol)
    answers = _answers(peer)
    assert {stream_id: answer["grpc-status"] for stream_id, answer in answers.items()} == dict.fromkeys(
        stream_ids, str(Status.INVALID_ARGUMENT.value))
    assert {answer["grpc-message"] for answer in answers.values()} == {
        f"malformed grpc-timeout {value!r}: expected 1 to 8 digits and a unit (H, M, S, m, u or n)"}
    assert started == []
    assert engine.num_started == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    peer.protocol.connection_lost(None)
    await _settle(peer.protocol)


async def test_a_direct_call_resumed_after_its_deadline_gives_back_what_it_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Found by the fuzzer: a direct call went on to a task (its response headers could not be written
    # directly) after its deadline had passed; grpclib's DeadlineWrapper raised before the method's rest
    # ran: UNKNOWN, "Timeout occurred" in the log, and what the call held never given back.
    held: list[object] = []

    async def rest(call: Stream[Any, Any]) -> None:  # the method's rest: it gives back what the call holds
        try:
            await asyncio.sleep(WAIT_S)
        finally:
            held.remove(call)

    def start(call: Stream[Any, Any], body: bytes, direct: DirectCall) -> bool:
        held.append(call)
        direct.on_cancel = lambda: held.remove(call)
        time.sleep(0.3)  # (its deadline passes here)
        direct.continue_in_task(rest)
        return True

    fast_path = functools.partial(FastPathHandler, fast_methods=(GENERATE,), direct={GENERATE: start})
    server = build_server([FakeEngineService(FakeEngine())], SecurityConfig(), handler_factory=fast_path)
    peer = Peer(server._protocol_factory())
    (stream_id,) = peer.call_each((GENERATE,), [("grpc-timeout", "200m")])
    await asyncio.sleep(0)  # the direct start (a loop callback), which hands the call to a task
    await _settle(peer.protocol)
    assert _statuses(peer) == {stream_id: str(Status.DEADLINE_EXCEEDED.value)}
    assert held == []
    assert server.guard_stats.num_direct_calls == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    peer.protocol.connection_lost(None)
    await _settle(peer.protocol)


async def test_a_direct_call_whose_task_is_cancelled_before_it_ran_gives_back_what_it_held() -> None:
    # Found by the fuzzer (a mutated stream): a direct call went on to a task (DirectCall.continue_in_task)
    # and the client's reset (or the connection's end) cancelled that task before its first step: nothing
    # gave back the call's engine request, stream-limit slot and in-flight count.
    held: list[object] = []

    async def rest(call: Stream[Any, Any]) -> None:  # the method's rest: it gives back what the call holds
        held.remove(call)
        raise GRPCError(Status.UNAVAILABLE)

    def start(call: Stream[Any, Any], body: bytes, direct: DirectCall) -> bool:
        held.append(call)
        direct.on_cancel = lambda: held.remove(call)
        direct.continue_in_task(rest)
        return True

    fast_path = functools.partial(FastPathHandler, fast_methods=(GENERATE,), direct={GENERATE: start})
    server = build_server([FakeEngineService(FakeEngine())], SecurityConfig(), handler_factory=fast_path)
    peer = Peer(server._protocol_factory())
    stream_ids = peer.open(1)
    # NOTE: one loop step (no sockets: the order is the loop's): the call's first step, queued by the read,
    # runs `start`, which creates the task; the task's first step is queued behind this test's
    await asyncio.sleep(0)
    assert held
    peer.reset(stream_ids)  # the next read, before the task's first step
    await _settle(peer.protocol)
    assert held == []
    assert not peer.protocol.processor.streams
    peer.protocol.connection_lost(None)
    await _settle(peer.protocol)


@_HANDLERS
async def test_binary_metadata_that_is_not_base64_is_invalid_argument(
    caplog: pytest.LogCaptureFixture, handler: str
) -> None:
    # Found by the fuzzer: grpclib's decode_metadata raises binascii.Error for it. On request_handler's path
    # that was "Server error" in the log and a stream never answered; in a direct call's first step (a loop
    # callback: the API key check reads the metadata there) "Exception in callback" and the same silence.
    engine = FakeEngine()
    started: list[Stream[Any, Any]] = []
    config = SecurityConfig(api_key="unit-test-api-key-0123456789")
    server = build_server([FakeEngineService(engine), Health()], config, **_handler_factory(handler, started))
    peer = Peer(server._protocol_factory())
    metadata = [("authorization", "Bearer unit-test-api-key-0123456789"), ("x-trace-bin", "not base64!")]
    stream_ids = peer.call_each(CALLED_PATHS, metadata)
    await _settle(peer.protocol)
    assert _statuses(peer) == dict.fromkeys(stream_ids, str(Status.INVALID_ARGUMENT.value))
    assert started == []
    assert engine.num_started == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    peer.protocol.connection_lost(None)
    await _settle(peer.protocol)
