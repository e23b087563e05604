"""The server assembly in process on a fake engine: error mapping, limits, start-up, failure and drain states.

Fast (no model): these cover the paths the real engine cannot be made to take on demand.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
from apiutil import CALL_TIMEOUT_S, Harness, completion_ids, finish_reasons, greedy_request
from engine_proto.engine.v1 import generate_pb2, info_pb2
from engine_server.api.config import ServerConfig
from engine_server.api.handle import EngineHandle
from engine_server.api.health import LIVENESS_SERVICE
from engine_server.api.security import SecurityConfig
from engine_server.api.server import EngineServer
from engine_server.engine.config import EngineConfig
from engine_server.engine.types import EngineOverloaded
from engine_server.frontend.outputs import EngineState
from fakes import FakeEngine
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

CONFIG = ServerConfig(port=0, metrics_port=None, drain_timeout_s=5.0)


async def _started(
    config: ServerConfig,
    engine: FakeEngine,
    *,
    gate: asyncio.Event | None = None,
    requested: asyncio.Event | None = None,
) -> EngineServer:
    async def start_engine() -> EngineHandle:
        if requested is not None:
            requested.set()  # the server listens before it starts the engine
        if gate is not None:
            await gate.wait()
        return engine

    server = EngineServer(config, engine_config=EngineConfig(model="/fake/model"), start_engine=start_engine)
    return server


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    engine = FakeEngine()
    server = await _started(replace(CONFIG, max_concurrent_streams=4, metrics_port=0), engine)
    await server.start()
    h = Harness(server, engine)
    yield h
    h.channel.close()
    await server.close()


async def test_generate_on_the_fake(harness: Harness) -> None:
    responses = await harness.stub.Generate(greedy_request([5, 6], max_tokens=3), timeout=CALL_TIMEOUT_S)
    assert completion_ids(responses) == [7, 8, 9]
    assert responses[-1].usage.completion_tokens == 3
    # Defaults of unset optional fields: temperature unset = 1.0 (0 would be greedy), n = 1.
    plain = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5]), stream=True)
    await harness.stub.Generate(plain, timeout=CALL_TIMEOUT_S)
    params = harness.engine.requests[-1].params
    assert (params.temperature, params.top_p, params.n, params.max_tokens) == (1.0, 1.0, 1, None)
    assert harness.engine.requests[-1].detokenize is True


async def test_unexpected_error_is_internal_with_a_generic_message(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    harness.engine.fail_with = RuntimeError("secret detail")
    with caplog.at_level(logging.ERROR), pytest.raises(GRPCError) as caught:
        await harness.stub.Generate(greedy_request([5], request_id="boom-1"), timeout=CALL_TIMEOUT_S)
    assert caught.value.status == Status.INTERNAL
    assert "secret" not in (caught.value.message or "")
    logged = [r for r in caplog.records if "boom-1" in r.getMessage()]
    assert logged
    assert logged[0].exc_info is not None  # the traceback stays in the server log


async def test_engine_error_mid_request_is_internal(harness: Harness) -> None:
    harness.engine.error_text = "the engine failed this request"
    with pytest.raises(GRPCError) as caught:
        await harness.stub.Generate(greedy_request([5]), timeout=CALL_TIMEOUT_S)
    assert caught.value.status == Status.INTERNAL


async def test_overloaded_engine_is_resource_exhausted(harness: Harness) -> None:
    harness.engine.fail_with = EngineOverloaded("too many pending requests")
    with pytest.raises(GRPCError) as caught:
        await harness.stub.Generate(greedy_request([5]), timeout=CALL_TIMEOUT_S)
    assert caught.value.status == Status.RESOURCE_EXHAUSTED


async def test_stream_limit_is_resource_exhausted_not_queued(harness: Harness) -> None:
    harness.engine.gate.clear()
    calls = [harness.stub.Generate.open(timeout=CALL_TIMEOUT_S) for _ in range(4)]
    for call in calls:
        await call.__aenter__()
        await call.send_message(greedy_request([5], max_tokens=2), end=True)
        assert await call.recv_message() is not None
    with pytest.raises(GRPCError) as caught:
        await harness.stub.Generate(greedy_request([5]), timeout=CALL_TIMEOUT_S)
    assert caught.value.status == Status.RESOURCE_EXHAUSTED
    harness.engine.gate.set()
    for call in calls:
        assert [m async for m in call]
        await call.__aexit__(None, None, None)
    assert await harness.stub.Generate(greedy_request([5]), timeout=CALL_TIMEOUT_S)


async def test_client_cancel_closes_the_engine_stream(harness: Harness) -> None:
    harness.engine.gate.clear()
    async with harness.stub.Generate.open(timeout=CALL_TIMEOUT_S) as call:
        await call.send_message(greedy_request([5], max_tokens=10), end=True)
        assert await call.recv_message() is not None
        await call.cancel()
    for _ in range(100):  # the RST_STREAM reaches the handler asynchronously
        if harness.engine.num_cancelled:
            break
        await asyncio.sleep(0.01)
    assert harness.engine.num_cancelled == 1
    assert not harness.engine.in_flight


async def test_metrics_count_calls_by_status(harness: Harness) -> None:
    await harness.stub.Generate(greedy_request([5], max_tokens=2), timeout=CALL_TIMEOUT_S)
    with pytest.raises(GRPCError):
        await harness.stub.Generate(greedy_request([VOCAB_OUTSIDE]), timeout=CALL_TIMEOUT_S)
    metrics = harness.server.metrics
    assert metrics is not None
    sample: Callable[[str, dict[str, str]], Any] = metrics.registry.get_sample_value
    assert sample("engine_requests_total", {"rpc": "Generate", "code": "OK"}) == 1
    assert sample("engine_requests_total", {"rpc": "Generate", "code": "INVALID_ARGUMENT"}) == 1
    assert sample("engine_generated_tokens_total", {}) == 2
    assert sample("engine_time_to_first_token_seconds_count", {}) == 1


VOCAB_OUTSIDE = 10_000


async def test_starting_server_is_unavailable_and_not_serving() -> None:
    engine = FakeEngine()
    gate, requested = asyncio.Event(), asyncio.Event()
    server = await _started(CONFIG, engine, gate=gate, requested=requested)
    starting = asyncio.create_task(server.start())
    try:
        await asyncio.wait_for(requested.wait(), CALL_TIMEOUT_S)
        h = Harness(server, engine)
        assert await h.health_status() == HealthCheckResponse.NOT_SERVING
        assert await h.health_status(LIVENESS_SERVICE) == HealthCheckResponse.SERVING  # loading is alive
        info = await h.stub.GetServerInfo(info_pb2.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S)
        assert info.state == info_pb2.ENGINE_STATE_STARTING
        with pytest.raises(GRPCError) as caught:
            await h.stub.Generate(greedy_request([5]), timeout=CALL_TIMEOUT_S)
        assert caught.value.status == Status.UNAVAILABLE
        gate.set()
        await starting
        assert await h.health_status() == HealthCheckResponse.SERVING
        assert await h.health_status("engine.v1.EngineService") == HealthCheckResponse.SERVING
        h.channel.close()
    finally:
        gate.set()
        await starting
        await server.close()


async def test_engine_failure_turns_health_not_serving(harness: Harness) -> None:
    assert await harness.health_status() == HealthCheckResponse.SERVING
    assert await harness.health_status(LIVENESS_SERVICE) == HealthCheckResponse.SERVING
    harness.engine.state = EngineState.FAILED
    assert await harness.health_status() == HealthCheckResponse.NOT_SERVING
    assert await harness.health_status(LIVENESS_SERVICE) == HealthCheckResponse.NOT_SERVING
    load = await harness.stub.GetLoad(info_pb2.GetLoadRequest(), timeout=CALL_TIMEOUT_S)
    assert load.state == info_pb2.ENGINE_STATE_FAILED
    with pytest.raises(GRPCError) as caught:
        await harness.stub.Generate(greedy_request([5]), timeout=CALL_TIMEOUT_S)
    assert caught.value.status == Status.UNAVAILABLE
    # The owner (api/runner.py) learns of it and stops the server: a failed engine never comes back.
    await asyncio.wait_for(harness.server.wait_engine_failed(), 10.0)
    assert harness.server.has_engine_failed
    await harness.server.stop_after_failure()
    with pytest.raises(ConnectionRefusedError):  # the port is closed
        await asyncio.open_connection("127.0.0.1", harness.server.port)


async def test_draining_is_alive(harness: Harness) -> None:
    harness.server.servicer.begin_drain()
    assert await harness.health_status() == HealthCheckResponse.NOT_SERVING
    assert await harness.health_status(LIVENESS_SERVICE) == HealthCheckResponse.SERVING


async def test_drain_aborts_streams_past_the_timeout() -> None:
    engine = FakeEngine()
    server = await _started(replace(CONFIG, drain_timeout_s=0.2), engine)
    await server.start()
    h = Harness(server, engine)
    engine.gate.clear()  # held in flight: cannot finish within the drain timeout
    try:
        async with h.stub.Generate.open(timeout=CALL_TIMEOUT_S) as call:
            await call.send_message(greedy_request([5], max_tokens=10), end=True)
            first = await call.recv_message()
            assert first is not None
            draining: Awaitable[None] = asyncio.create_task(server.drain())
            rest = [m async for m in call]  # status OK
        await draining
    finally:
        h.channel.close()
        await server.close()
    assert finish_reasons([first, *rest]) == {0: generate_pb2.FINISH_REASON_ABORT}
    assert rest[-1].HasField("usage")


async def test_health_watch_sees_an_engine_failure(harness: Harness) -> None:
    async with harness.health.Watch.open(timeout=CALL_TIMEOUT_S) as call:
        await call.send_message(HealthCheckRequest(service="engine.v1.EngineService"), end=True)
        first = await call.recv_message()
        assert first is not None
        assert first.status == HealthCheckResponse.SERVING
        harness.engine.state = EngineState.FAILED
        # The server's monitor notices between calls (about once a second).
        second = await asyncio.wait_for(call.recv_message(), 10.0)
        assert second is not None
        assert second.status == HealthCheckResponse.NOT_SERVING
        await call.cancel()


async def _list_services(channel: Channel) -> list[str]:
    from grpclib.reflection.v1.reflection_grpc import ServerReflectionStub
    from grpclib.reflection.v1.reflection_pb2 import ServerReflectionRequest

    async with ServerReflectionStub(channel).ServerReflectionInfo.open(timeout=CALL_TIMEOUT_S) as call:
        await call.send_message(ServerReflectionRequest(list_services=""), end=True)
        response = await call.recv_message()
        assert response is not None
        return [service.name for service in response.list_services_response.service]


async def test_with_an_api_key_health_and_reflection_need_none() -> None:
    # What --help and docs/deploy.md say: the key guards every call but health and reflection.
    key = "k" * 32
    engine = FakeEngine()
    server = await _started(replace(CONFIG, security=SecurityConfig(api_key=key)), engine)
    await server.start()
    h = Harness(server, engine)
    try:
        assert await h.health_status() == HealthCheckResponse.SERVING
        assert "engine.v1.EngineService" in await _list_services(h.channel)
        with pytest.raises(GRPCError) as caught:
            await h.stub.GetLoad(info_pb2.GetLoadRequest(), timeout=CALL_TIMEOUT_S)
        assert caught.value.status == Status.UNAUTHENTICATED
        load = await h.stub.GetLoad(info_pb2.GetLoadRequest(), metadata={"x-api-key": key},
                                    timeout=CALL_TIMEOUT_S)
        assert load.state == info_pb2.ENGINE_STATE_SERVING
    finally:
        h.channel.close()
        await server.close()


@pytest.mark.parametrize("enabled", [True, False])
async def test_reflection_can_be_turned_off(enabled: bool) -> None:
    engine = FakeEngine()
    server = await _started(replace(CONFIG, enable_reflection=enabled), engine)
    await server.start()
    channel = Channel("127.0.0.1", server.port)
    try:
        if enabled:
            assert "engine.v1.EngineService" in await _list_services(channel)
        else:
            with pytest.raises(GRPCError) as caught:
                await _list_services(channel)
            # grpclib answers an unknown method trailers-only with UNIMPLEMENTED and no content-type, which
            # grpclib's own client reports as UNKNOWN "Missing content-type header" (grpcurl: UNIMPLEMENTED).
            assert caught.value.status in (Status.UNIMPLEMENTED, Status.UNKNOWN)
    finally:
        channel.close()
        await server.close()
