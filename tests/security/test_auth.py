"""API key: missing / wrong -> UNAUTHENTICATED before the servicer runs; right -> OK; health needs none."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from engine_proto.engine.v1 import generate_pb2, tokenize_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_server.api.security import SecurityConfig
from engine_server.api.security.auth import presented_key, resolve_api_key
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from sec_fakes import WAIT_S, serve

KEY = "s3cret-key_0123456789"


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"authorization": f"Bearer {KEY}"}, Status.OK),
        ({"authorization": f"bearer {KEY}"}, Status.OK),
        ({"x-api-key": KEY}, Status.OK),
        ({}, Status.UNAUTHENTICATED),
        ({"authorization": f"Bearer {KEY}x"}, Status.UNAUTHENTICATED),
        ({"authorization": f"Bearer {KEY[:-1]}"}, Status.UNAUTHENTICATED),
        ({"authorization": KEY}, Status.UNAUTHENTICATED),  # no scheme
        ({"authorization": f"Basic {KEY}"}, Status.UNAUTHENTICATED),
        ({"x-api-key": "wrong"}, Status.UNAUTHENTICATED),
        ({"authorization": "Bearer "}, Status.UNAUTHENTICATED),
    ],
)
async def test_api_key_on_every_call(metadata: dict[str, str], expected: Status) -> None:
    async with serve(SecurityConfig(api_key=KEY)) as served:
        channel = Channel("127.0.0.1", served.port)
        try:
            stub = EngineServiceStub(channel)
            request = tokenize_pb2.TokenizeRequest(text="hi")
            if expected is Status.OK:
                reply = await stub.Tokenize(request, metadata=metadata, timeout=WAIT_S)
                assert list(reply.token_ids) == [ord("h"), ord("i")]
            else:
                with pytest.raises(GRPCError) as err:
                    await stub.Tokenize(request, metadata=metadata, timeout=WAIT_S)
                assert err.value.status is expected
                assert err.value.message == "missing or invalid API key"
                # Streaming RPCs are checked too, and the engine never sees the call.
                with pytest.raises(GRPCError) as err:
                    await stub.Generate(
                        generate_pb2.GenerateRequest(request_id="r"), metadata=metadata, timeout=WAIT_S
                    )
                assert err.value.status is expected
                assert served.engine.num_started == 0
        finally:
            channel.close()


async def test_health_is_reachable_without_key() -> None:
    async with serve(SecurityConfig(api_key=KEY)) as served:
        channel = Channel("127.0.0.1", served.port)
        try:
            reply = await HealthStub(channel).Check(HealthCheckRequest(), timeout=WAIT_S)
            assert reply.status == HealthCheckResponse.SERVING
            # The exemption is per service: the engine service still needs the key on this connection.
            with pytest.raises(GRPCError) as err:
                await EngineServiceStub(channel).Tokenize(
                    tokenize_pb2.TokenizeRequest(text="x"), timeout=WAIT_S
                )
            assert err.value.status is Status.UNAUTHENTICATED
        finally:
            channel.close()


async def test_no_key_configured_means_no_auth() -> None:
    async with serve(SecurityConfig()) as served:
        channel = Channel("127.0.0.1", served.port)
        try:
            reply = await EngineServiceStub(channel).Tokenize(
                tokenize_pb2.TokenizeRequest(text="a"), timeout=WAIT_S
            )
            assert list(reply.token_ids) == [ord("a")]
        finally:
            channel.close()


def test_presented_key_prefers_authorization() -> None:
    assert presented_key({"authorization": "Bearer a", "x-api-key": "b"}) == "a"
    assert presented_key({"authorization": "Basic a", "x-api-key": "b"}) == "b"
    assert presented_key({}) is None


def test_resolve_api_key(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\n")
    assert resolve_api_key(api_key_file=str(key_file), environ={}) == KEY
    assert resolve_api_key(api_key="flag", environ={"ENGINE_API_KEY": "env"}) == "flag"
    assert resolve_api_key(environ={"ENGINE_API_KEY": "env"}) == "env"
    assert resolve_api_key(environ={}) is None
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key(api_key="a", api_key_file=str(key_file), environ={})
    with pytest.raises(ValueError, match="cannot read"):
        resolve_api_key(api_key_file=str(key_file) + ".missing", environ={})


async def test_later_listeners_see_rejected_calls_with_their_status() -> None:
    # What the metrics layer does: wrap the method (installed after build_server) and record the status.
    seen: list[tuple[str, Status]] = []

    async def on_request(event: RecvRequest) -> None:
        method_func = event.method_func

        async def observed(stream: Any) -> None:
            try:
                await method_func(stream)
            except GRPCError as exc:
                seen.append((event.method_name, exc.status))
                raise
            seen.append((event.method_name, Status.OK))

        event.method_func = observed

    async with serve(SecurityConfig(api_key=KEY)) as served:
        listen(served.server, RecvRequest, on_request)
        channel = Channel("127.0.0.1", served.port)
        try:
            stub = EngineServiceStub(channel)
            with pytest.raises(GRPCError):
                await stub.Tokenize(tokenize_pb2.TokenizeRequest(text="a"), timeout=WAIT_S)
            await stub.Tokenize(
                tokenize_pb2.TokenizeRequest(text="a"), metadata={"x-api-key": KEY}, timeout=WAIT_S
            )
        finally:
            channel.close()
    tokenize = "/engine.v1.EngineService/Tokenize"
    assert seen == [(tokenize, Status.UNAUTHENTICATED), (tokenize, Status.OK)]


async def test_rejections_are_logged_once_then_counted(caplog: pytest.LogCaptureFixture) -> None:
    # A client can send calls without the key at will: one line each buried the log. The first is logged,
    # the rest counted in one line (at the end of the interval, or when the server closes).
    caplog.set_level(logging.INFO, logger="engine_server.api.security.auth")
    num_calls = 50
    async with serve(SecurityConfig(api_key=KEY)) as served:
        channel = Channel("127.0.0.1", served.port)
        try:
            stub = EngineServiceStub(channel)
            for _ in range(num_calls):
                with pytest.raises(GRPCError):
                    await stub.Tokenize(tokenize_pb2.TokenizeRequest(text="a"), timeout=WAIT_S)
        finally:
            channel.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "engine_server.api.security.auth"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("rejected call to /engine.v1.EngineService/Tokenize from ")
    assert lines[1].startswith(f"... and {num_calls - 1} more in the last ")
    assert lines[1].endswith(" s: calls rejected for a missing or invalid API key")
