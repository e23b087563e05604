"""Drain sends HTTP/2 GOAWAY(NO_ERROR): idle connections at once, busy ones when their last stream ends.

An EngineServer on the api tests' fake engine (its `gate` holds streams in flight); raw HTTP/2 connections see
the frames, and the real Python clients (grpcio: the early GOAWAY; grpclib: GOAWAY only once idle) keep their
streams through a drain and get UNAVAILABLE, not a hang, for calls made after it began.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from api.fakes import FakeEngine
from engine_client import AsyncEngineClient, EngineClient, FinishReason, UnavailableError
from engine_proto.engine.v1 import generate_pb2
from engine_proto.engine.v1.tokenize_pb2 import TokenizeRequest
from engine_server.api.config import ServerConfig
from engine_server.api.server import EngineServer
from engine_server.engine.config import EngineConfig
from h2.errors import ErrorCodes
from h2.events import DataReceived, TrailersReceived
from sec_fakes import WAIT_S
from sec_raw_h2 import RawH2, raw_h2, text_headers

GENERATE = "/engine.v1.EngineService/Generate"
TOKENIZE = "/engine.v1.EngineService/Tokenize"
PROMPT = [5]  # the fake generates 6, 7, 8, ...
NUM_TOKENS = 3
GENERATE_REQUEST = generate_pb2.GenerateRequest(
    token_ids=generate_pb2.TokenIds(ids=PROMPT),
    stream=True,
    stopping=generate_pb2.StoppingCriteria(max_tokens=NUM_TOKENS),
).SerializeToString()
GRPC_GO = (("user-agent", "grpc-go/1.70.0"),)


@contextlib.asynccontextmanager
async def started() -> AsyncIterator[tuple[EngineServer, FakeEngine]]:
    engine = FakeEngine()

    async def start_engine() -> FakeEngine:
        return engine

    config = replace(ServerConfig(port=0, metrics_port=None), drain_timeout_s=WAIT_S)
    server = EngineServer(config, engine_config=EngineConfig(model="/fake/model"), start_engine=start_engine)
    await server.start()
    try:
        yield server, engine
    finally:
        engine.gate.set()
        await server.close()


@contextlib.asynccontextmanager
async def draining(server: EngineServer) -> AsyncIterator[asyncio.Task[None]]:
    """drain() running in the background; the block ends with it finished (bounded)."""
    task = asyncio.create_task(server.drain())
    try:
        yield task
        await asyncio.wait_for(task, WAIT_S)
    finally:
        task.cancel()


async def round_trip(raw: RawH2) -> None:
    """A PING answered: every frame the server sent before the ACK has been read."""
    num_acks = raw.num_ping_acks
    raw.conn.ping(b"drain-rt")
    await raw.flush()
    await raw.wait_until(lambda: raw.num_ping_acks > num_acks or raw.is_closed)


def responses(raw: RawH2, stream_id: int) -> list[generate_pb2.GenerateResponse]:
    data = b"".join(e.data for e in raw.events if isinstance(e, DataReceived) and e.stream_id == stream_id)
    messages = []
    while data:
        (length,) = struct.unpack(">I", data[1:5])
        messages.append(generate_pb2.GenerateResponse.FromString(data[5 : 5 + length]))
        data = data[5 + length :]
    return messages


def grpc_status(raw: RawH2, stream_id: int) -> str | None:
    for event in raw.events:
        if isinstance(event, TrailersReceived) and event.stream_id == stream_id:
            return dict(text_headers(event)).get("grpc-status")
    return None


def token_ids(messages: list[generate_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for c in m.completions for t in c.token_ids]


async def test_idle_connections_get_goaway_when_drain_begins_busy_ones_after_their_last_stream() -> None:
    async with started() as (server, engine), raw_h2(server.port) as silent, raw_h2(
        server.port
    ) as finished, raw_h2(server.port) as busy:
        called = finished.start_call(TOKENIZE, TokenizeRequest(text="x").SerializeToString())
        await finished.flush()
        await finished.wait_stream_done(called)
        engine.gate.clear()  # the Generate stays in flight after its first message
        streaming = busy.start_call(GENERATE, GENERATE_REQUEST)
        await busy.flush()
        await busy.wait_until(lambda: len(responses(busy, streaming)) == 1)

        async with draining(server) as drain:
            for raw, last_stream_id in ((silent, 0), (finished, called)):
                await raw.wait_closed()
                assert raw.goaway is not None
                assert (raw.goaway.error_code, raw.goaway.additional_data) == (ErrorCodes.NO_ERROR, b"drain")
                assert raw.goaway.last_stream_id == last_stream_id
            await round_trip(busy)
            goaway_while_busy = busy.goaway  # (a copy: mypy would keep `busy.goaway` narrowed to None below)
            assert goaway_while_busy is None, "GOAWAY while a stream was open (grpclib clients would lose it)"
            assert not drain.done()

            engine.gate.set()
            await busy.wait_closed()
        assert busy.goaway is not None
        assert (busy.goaway.error_code, busy.goaway.last_stream_id) == (ErrorCodes.NO_ERROR, streaming)
        assert token_ids(responses(busy, streaming)) == [6, 7, 8]
        assert grpc_status(busy, streaming) == "0"
        assert busy.events.index(busy.goaway) > max(
            i for i, e in enumerate(busy.events) if isinstance(e, TrailersReceived)
        )
    assert server._server.guard_stats.goaways == {"drain": 3}


async def test_a_client_known_to_keep_its_streams_gets_an_early_goaway() -> None:
    async with started() as (server, engine), raw_h2(server.port, metadata=GRPC_GO) as raw:
        engine.gate.clear()
        stream_id = raw.start_call(GENERATE, GENERATE_REQUEST)
        await raw.flush()
        await raw.wait_until(lambda: len(responses(raw, stream_id)) == 1)
        async with draining(server):
            # NOTE: only the frame is checked here: the h2 state machine of this raw client (like grpclib's)
            # takes any GOAWAY as the end; grpcio's keeping its stream is tested below.
            await raw.wait_until(lambda: raw.goaway is not None)
            assert raw.goaway is not None
            assert (raw.goaway.error_code, raw.goaway.last_stream_id) == (ErrorCodes.NO_ERROR, 2**31 - 1)
            assert engine.in_flight, "the stream must still be running"
            engine.gate.set()


async def test_grpcio_keeps_its_stream_through_a_drain_and_new_calls_are_unavailable() -> None:
    async with started() as (server, engine):
        client = EngineClient(f"127.0.0.1:{server.port}", timeout=WAIT_S)
        try:
            assert (await asyncio.to_thread(client.complete, token_ids=PROMPT, max_tokens=2)).text
            engine.gate.clear()
            stream = client.generate(token_ids=PROMPT, max_tokens=NUM_TOKENS, temperature=0.0)
            first = await asyncio.to_thread(next, stream)
            async with draining(server):
                with pytest.raises(UnavailableError):
                    await asyncio.to_thread(client.complete, token_ids=PROMPT, max_tokens=2)
                engine.gate.set()
                rest = await asyncio.to_thread(list, stream)
        finally:
            client.close()
    chunks = [first, *rest]
    assert [t for c in chunks for t in c.token_ids] == [6, 7, 8]
    assert chunks[-1].finish_reason == FinishReason.LENGTH


async def test_grpclib_client_keeps_its_stream_through_a_drain_and_new_calls_are_unavailable() -> None:
    async with started() as (server, engine), AsyncEngineClient(
        f"127.0.0.1:{server.port}", timeout=WAIT_S
    ) as client:
        assert (await client.complete(token_ids=PROMPT, max_tokens=2)).text
        engine.gate.clear()
        stream = client.generate(token_ids=PROMPT, max_tokens=NUM_TOKENS, temperature=0.0)
        first = await anext(stream)
        async with draining(server):
            with pytest.raises(UnavailableError):
                await client.complete(token_ids=PROMPT, max_tokens=2)
            engine.gate.set()
            rest = [chunk async for chunk in stream]
    chunks = [first, *rest]
    assert [t for c in chunks for t in c.token_ids] == [6, 7, 8]
    assert chunks[-1].finish_reason == FinishReason.LENGTH
