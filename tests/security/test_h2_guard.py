"""HTTP/2 abuse from a raw client: PING flood, rapid reset, control-frame floods -> GOAWAY and close; streams
past the advertised limit -> refused alone; the warnings of many such connections -> rate-limited.

Every flood is bounded in frames and time; a well-behaved client on another connection is served throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest
from engine_proto.engine.v1 import generate_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_proto.engine.v1.tokenize_pb2 import TokenizeRequest
from engine_server.api.security import H2Policy, SecurityConfig
from grpclib.client import Channel
from h2.errors import ErrorCodes
from h2.events import DataReceived, ResponseReceived, StreamReset, TrailersReceived
from sec_fakes import WAIT_S, Served, serve
from sec_raw_h2 import RawH2, raw_h2, text_headers

TOKENIZE = "/engine.v1.EngineService/Tokenize"
GENERATE = "/engine.v1.EngineService/Generate"


class Bystander:
    """A normal grpclib client calling Generate in a loop on its own connection."""

    def __init__(self, port: int) -> None:
        self.num_ok = 0
        self._channel = Channel("127.0.0.1", port)
        self._stub = EngineServiceStub(self._channel)

    async def call(self) -> None:
        request = generate_pb2.GenerateRequest(
            request_id="bystander", stopping=generate_pb2.StoppingCriteria(max_tokens=3)
        )
        replies = await self._stub.Generate(request, timeout=WAIT_S)
        assert [r.completions[0].token_ids[0] for r in replies] == [0, 1, 2]
        self.num_ok += 1

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.call()


@contextlib.asynccontextmanager
async def bystander(port: int) -> AsyncIterator[Bystander]:
    """Served before, during (at least one call while the block runs) and after the block."""
    client = Bystander(port)
    stop = asyncio.Event()
    await client.call()
    task = asyncio.get_running_loop().create_task(client.run(stop))
    try:
        yield client
        num_before_stop = client.num_ok
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
        await client.call()
        assert num_before_stop > 1, "the bystander was not served during the flood"
    finally:
        task.cancel()
        client._channel.close()


def _is_closed(raw: RawH2) -> bool:
    """`raw.is_closed` as a call: mypy would keep the property narrowed to False across the awaits that
    change it (and call a later check unreachable)."""
    return raw.is_closed


def assert_calm_goaway(raw: RawH2, reason: bytes) -> None:
    assert raw.goaway is not None, "no GOAWAY"
    assert raw.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert raw.goaway.additional_data == reason


async def flood(raw: RawH2, queue_frames: Callable[[], object], *, max_batches: int, batch: int) -> int:
    """Send batches of frames until the server hangs up; returns how many were sent."""
    num_sent = 0
    for _ in range(max_batches):
        if raw.is_closed:
            break
        for _ in range(batch):
            queue_frames()
        num_sent += batch
        await raw.flush()
    await raw.wait_closed()
    return num_sent


async def test_ping_flood_gets_goaway_after_a_few_pings() -> None:
    async with serve(SecurityConfig()) as served, bystander(served.port), raw_h2(served.port) as raw:
        started = time.monotonic()
        payload = b"flood!!!"
        num_sent = await flood(raw, lambda: raw.conn.ping(payload), max_batches=100, batch=1000)
        assert_calm_goaway(raw, b"too_many_pings")
        # grpc-core's policy: the 4th PING without data in between is one too many; their ACKs were dropped.
        assert raw.num_ping_acks <= 3
        assert num_sent <= 2000, "the server kept reading the flood"
        assert time.monotonic() - started < 5
        assert served.server.guard_stats.goaways == {"too_many_pings": 1}


async def test_pings_between_responses_are_fine() -> None:
    # BDP / keepalive pings from real clients come with traffic: every response resets the strikes.
    async with serve(SecurityConfig()) as served, raw_h2(served.port) as raw:
        for _ in range(10):
            raw.conn.ping(b"12345678")
            raw.conn.ping(b"87654321")
            stream_id = raw.start_call(TOKENIZE, TokenizeRequest(text="x").SerializeToString())
            await raw.flush()
            await raw.wait_stream_done(stream_id)
        assert raw.goaway is None
        assert not raw.is_closed
        assert raw.num_ping_acks == 20
        assert served.server.guard_stats.goaways == {}


async def _rapid_reset(served: Served, *, num_streams: int) -> RawH2:
    message = generate_pb2.GenerateRequest(request_id="rr").SerializeToString()  # never finishes if run
    async with raw_h2(served.port) as raw:
        await flood(
            raw,
            lambda: raw.start_call(GENERATE, message, reset=True),
            max_batches=num_streams // 100,
            batch=100,
        )
        return raw


async def test_rapid_reset_gets_goaway_and_never_reaches_the_engine() -> None:
    policy = H2Policy()
    async with serve(SecurityConfig(h2=policy)) as served, bystander(served.port):
        started = time.monotonic()
        raw = await _rapid_reset(served, num_streams=20_000)
        assert_calm_goaway(raw, b"rapid_reset")
        assert time.monotonic() - started < 10
        stats = served.server.guard_stats
        assert stats.goaways == {"rapid_reset": 1}
        # Opened and reset in one read: dropped before grpclib made a handler, so the engine saw ~nothing.
        assert stats.num_dropped_streams >= policy.reset_burst * 0.9
        await served.engine.wait_for(lambda: not served.engine.running)
        assert served.engine.num_started <= 10


async def test_reset_of_running_streams_aborts_engine_requests() -> None:
    # The slow variant: calls start (reach the engine), then the client resets them.
    async with serve(SecurityConfig()) as served, raw_h2(served.port) as raw:
        message = generate_pb2.GenerateRequest(request_id="slow").SerializeToString()
        stream_ids = [raw.start_call(GENERATE, message) for _ in range(50)]
        await raw.flush()
        await served.engine.wait_for(
            lambda: len(served.engine.running) == 1 and served.engine.num_started == 50
        )
        for stream_id in stream_ids:
            raw.conn.reset_stream(stream_id, error_code=ErrorCodes.CANCEL)
        await raw.flush()
        await served.engine.wait_for(lambda: served.engine.num_aborted == 50 and not served.engine.running)
        assert raw.goaway is None  # 50 cancellations are normal client behaviour
        # ...and the connection still works.
        stream_id = raw.start_call(TOKENIZE, TokenizeRequest(text="y").SerializeToString())
        await raw.flush()
        await raw.wait_stream_done(stream_id)
        assert not raw.is_closed


@pytest.mark.parametrize("frame", ["settings", "window_update", "unknown"])
async def test_control_frame_flood_gets_goaway(frame: str) -> None:
    async with serve(SecurityConfig()) as served, bystander(served.port), raw_h2(served.port) as raw:
        if frame == "settings":
            queue = lambda: raw.conn.update_settings({})  # noqa: E731
        elif frame == "window_update":
            queue = lambda: raw.conn.increment_flow_control_window(1)  # noqa: E731
        else:
            # Type 0xFA is unassigned: a peer must ignore it (grpclib alone raises NotImplementedError).
            queue = lambda: raw.conn._data_to_send.extend(b"\x00\x00\x00\xfa\x00\x00\x00\x00\x00")  # noqa: E731
        num_sent = await flood(raw, queue, max_batches=100, batch=500)
        assert_calm_goaway(raw, b"control_frame_flood")
        assert num_sent <= 3 * H2Policy().control_frame_burst
        assert served.server.guard_stats.goaways == {"control_frame_flood": 1}


async def test_rapid_reset_in_separate_reads_is_bounded_by_the_reset_budget() -> None:
    # The variant that does reach handlers: a batch of calls, then (next read) their resets, again and again.
    policy = H2Policy(reset_burst=300, reset_rate_per_s=10.0)
    message = generate_pb2.GenerateRequest(request_id="rr2").SerializeToString()
    async with serve(SecurityConfig(h2=policy)) as served:
        async with bystander(served.port), raw_h2(served.port) as raw:
            for _ in range(50):
                if _is_closed(raw):
                    break
                stream_ids = [raw.start_call(GENERATE, message) for _ in range(100)]
                await raw.flush()
                if raw.is_closed:
                    break
                for stream_id in stream_ids:
                    raw.conn.reset_stream(stream_id, error_code=ErrorCodes.CANCEL)
                await raw.flush()
            await raw.wait_closed()
            assert_calm_goaway(raw, b"rapid_reset")
        # At most the budget (plus the batch in flight) reached the engine, and all of it was aborted.
        await served.engine.wait_for(lambda: served.engine.num_running == 0)
        assert served.engine.num_aborted <= policy.reset_burst + 100


async def test_a_stream_past_the_advertised_limit_is_refused_alone() -> None:
    # RFC 9113 5.1.2: a stream past SETTINGS_MAX_CONCURRENT_STREAMS is a stream error, REFUSED_STREAM (gRPC
    # clients retry it: nothing was processed). h2 alone made it a connection error: GOAWAY(PROTOCOL_ERROR),
    # and every other stream of the connection was lost.
    limit = 4
    request = generate_pb2.GenerateRequest(
        request_id="held", stopping=generate_pb2.StoppingCriteria(max_tokens=3)
    ).SerializeToString()
    held: list[int] = []
    extra: list[int] = []

    def open_past_the_limit(raw: RawH2) -> None:
        # Sent with the preface (the client has not read the limit yet); the first streams are held open
        # (not ended by the client: counted until the end of the test, however fast they are answered)
        held.extend(raw.start_call(GENERATE, request, end_stream=False) for _ in range(limit))
        extra.append(raw.start_call(GENERATE, request))

    config = SecurityConfig(h2=H2Policy(max_concurrent_streams=limit))
    async with serve(config) as served, raw_h2(served.port, with_preface=open_past_the_limit) as raw:
        (refused,) = extra
        await raw.wait_stream_done(refused)
        resets = [e for e in raw.events if isinstance(e, StreamReset)]
        assert [(e.stream_id, e.error_code) for e in resets] == [(refused, ErrorCodes.REFUSED_STREAM)]
        # The other streams are answered in full, and the connection serves on.
        await raw.wait_until(lambda: all(_status(raw, stream_id) is not None for stream_id in held))
        assert [_status(raw, stream_id) for stream_id in held] == ["0"] * limit
        assert [len(_messages(raw, stream_id)) for stream_id in held] == [3] * limit
        for stream_id in held:
            raw.conn.end_stream(stream_id)
        after = raw.start_call(GENERATE, request)
        await raw.flush()
        await raw.wait_until(lambda: _status(raw, after) is not None)
        assert _status(raw, after) == "0"
        assert raw.goaway is None
        assert not raw.is_closed
        assert served.engine.num_started == limit + 1  # the refused stream never reached the engine
        assert served.server.guard_stats.num_refused_streams == 1
        assert served.server.guard_stats.goaways == {}


async def test_streams_refused_past_the_limit_spend_the_reset_budget() -> None:
    # Each refusal costs the server a header block's decoding and a frame: a client that keeps opening
    # streams past the limit is closed like one that keeps resetting them.
    policy = H2Policy(max_concurrent_streams=2, reset_burst=20, reset_rate_per_s=1.0)
    message = generate_pb2.GenerateRequest(request_id="endless").SerializeToString()  # never finishes

    def flood_past_the_limit(raw: RawH2) -> None:
        for _ in range(2 + 30):
            raw.start_call(GENERATE, message)

    async with serve(SecurityConfig(h2=policy)) as served, bystander(served.port):
        async with raw_h2(served.port, with_preface=flood_past_the_limit) as raw:
            await raw.wait_closed()
            assert_calm_goaway(raw, b"too_many_refused_streams")
        stats = served.server.guard_stats
        assert stats.goaways == {"too_many_refused_streams": 1}
        assert stats.num_refused_streams == policy.reset_burst + 1
        await served.engine.wait_for(lambda: served.engine.num_running == 0)


async def test_goaway_warnings_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    # One line per abusive connection let a client write the log at will (1,212 lines in one campaign): the
    # first is logged, the rest counted in one line (at the end of the interval, or when the server closes).
    num_connections = 40
    async with serve(SecurityConfig()) as served:
        for _ in range(num_connections):
            async with raw_h2(served.port) as raw:
                await flood(raw, lambda: raw.conn.ping(b"12345678"), max_batches=10, batch=10)
        assert served.server.guard_stats.goaways == {"too_many_pings": num_connections}
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("h2_guard")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("closing HTTP/2 connection from ")
    assert lines[0].endswith(": too_many_pings (GOAWAY ENHANCE_YOUR_CALM)")
    assert lines[1].startswith(f"... and {num_connections - 1} more in the last ")
    assert lines[1].endswith(" s: HTTP/2 connections closed for too_many_pings")


def _headers_of(raw: RawH2, stream_id: int) -> dict[str, str]:
    headers: dict[str, str] = {}
    for event in raw.events:
        if isinstance(event, ResponseReceived | TrailersReceived) and event.stream_id == stream_id:
            headers.update(text_headers(event))
    return headers


def _status(raw: RawH2, stream_id: int) -> str | None:
    return _headers_of(raw, stream_id).get("grpc-status")


def _messages(raw: RawH2, stream_id: int) -> list[bytes]:
    return [e.data for e in raw.events if isinstance(e, DataReceived) and e.stream_id == stream_id]
