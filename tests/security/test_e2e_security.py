"""The real `engine-server` (tiny model) with mTLS, an API key and a small message limit, attacked end to end.

One server for the module: starting it dominates the run time (tens of seconds on two shared cores).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterator

import pytest
from engine_proto.engine.v1 import generate_pb2, info_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_proto.engine.v1.tokenize_pb2 import TokenizeRequest
from engine_server.api.security.tls import build_client_ssl_context
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from h2.errors import ErrorCodes
from h2.events import DataReceived
from sec_certs import CertFiles
from sec_fakes import WAIT_S
from sec_raw_h2 import raw_h2
from serverproc import RunningServer, start_server

pytestmark = pytest.mark.slow

KEY = "e2e-key-0123456789abcdef"
AUTH = {"authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024
GENERATE = "/engine.v1.EngineService/Generate"


@pytest.fixture(scope="module")
def server(cert_files: CertFiles) -> Iterator[RunningServer]:
    args = ["--in-process-engine", "--num-kv-blocks", "512", "--max-receive-message-size", str(LIMIT)]
    args += ["--tls-cert", cert_files.server_cert, "--tls-key", cert_files.server_key]
    args += ["--tls-client-ca", cert_files.ca]
    with start_server(*args, env={"ENGINE_API_KEY": KEY}) as running:
        yield running
        log = running.log()
    # The attacks were handled, not crashed through: no tracebacks, one warning per closed connection.
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture
def client_ssl(cert_files: CertFiles) -> ssl.SSLContext:
    return build_client_ssl_context(
        ca_file=cert_files.ca, cert_file=cert_files.client_cert, key_file=cert_files.client_key
    )


def _long_request(request_id: str) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=generate_pb2.TokenIds(ids=[5, 6, 7, 8]),
        stopping=generate_pb2.StoppingCriteria(max_tokens=1000, ignore_eos=True),
        stream=True,
    )


async def _wait_engine_idle(stub: EngineServiceStub) -> info_pb2.Load:
    # NOTE: another process: poll its load, bounded by WAIT_S.
    deadline = time.monotonic() + WAIT_S
    while True:
        reply = await stub.GetLoad(info_pb2.GetLoadRequest(), metadata=AUTH, timeout=WAIT_S)
        load = reply.load
        if load.num_running_requests == 0 and load.num_waiting_requests == 0:
            return load
        assert time.monotonic() < deadline, f"engine still busy: {load}"
        await asyncio.sleep(0.05)


async def test_mtls_api_key_and_health(
    server: RunningServer, client_ssl: ssl.SSLContext, cert_files: CertFiles
) -> None:
    channel = Channel("127.0.0.1", server.port, ssl=client_ssl)
    try:
        stub = EngineServiceStub(channel)
        health = await HealthStub(channel).Check(HealthCheckRequest(), timeout=WAIT_S)
        assert health.status == HealthCheckResponse.SERVING
        with pytest.raises(GRPCError) as err:
            await stub.Tokenize(TokenizeRequest(text="hi"), timeout=WAIT_S)
        assert err.value.status is Status.UNAUTHENTICATED
        with pytest.raises(GRPCError) as err:
            await stub.Tokenize(TokenizeRequest(text="hi"), metadata={"x-api-key": KEY + "!"}, timeout=WAIT_S)
        assert err.value.status is Status.UNAUTHENTICATED
        reply = await stub.Tokenize(TokenizeRequest(text="hi"), metadata=AUTH, timeout=WAIT_S)
        assert len(reply.token_ids) > 0
    finally:
        channel.close()
    no_cert = Channel("127.0.0.1", server.port, ssl=build_client_ssl_context(ca_file=cert_files.ca))
    try:
        with pytest.raises((StreamTerminatedError, ConnectionError)):
            await HealthStub(no_cert).Check(HealthCheckRequest(), timeout=WAIT_S)
    finally:
        no_cert.close()


async def test_oversized_message(server: RunningServer, client_ssl: ssl.SSLContext) -> None:
    channel = Channel("127.0.0.1", server.port, ssl=client_ssl)
    try:
        stub = EngineServiceStub(channel)
        with pytest.raises(GRPCError) as err:
            await stub.Tokenize(TokenizeRequest(text="a" * (LIMIT + 1)), metadata=AUTH, timeout=WAIT_S)
        assert err.value.status is Status.RESOURCE_EXHAUSTED
        reply = await stub.Tokenize(TokenizeRequest(text="still serving"), metadata=AUTH, timeout=WAIT_S)
        assert len(reply.token_ids) > 0
    finally:
        channel.close()


async def test_floods_get_goaway_and_leave_the_engine_idle(
    server: RunningServer, client_ssl: ssl.SSLContext
) -> None:
    channel = Channel("127.0.0.1", server.port, ssl=client_ssl)
    metadata = tuple(AUTH.items())
    message = _long_request("rr").SerializeToString()
    try:
        stub = EngineServiceStub(channel)
        # 1) rapid reset
        async with raw_h2(server.port, ssl=client_ssl, metadata=metadata) as raw:
            for _ in range(100):
                if raw.is_closed:
                    break
                for _ in range(100):
                    raw.start_call(GENERATE, message, reset=True)
                await raw.flush()
            await raw.wait_closed()
            assert raw.goaway is not None
            assert (raw.goaway.error_code, raw.goaway.additional_data) == (
                ErrorCodes.ENHANCE_YOUR_CALM,
                b"rapid_reset",
            )
        # 2) PING flood
        async with raw_h2(server.port, ssl=client_ssl) as raw:
            for _ in range(100):
                if raw.is_closed:
                    break
                for _ in range(1000):
                    raw.conn.ping(b"01234567")
                await raw.flush()
            await raw.wait_closed()
            assert raw.goaway is not None
            assert (raw.goaway.error_code, raw.goaway.additional_data) == (
                ErrorCodes.ENHANCE_YOUR_CALM,
                b"too_many_pings",
            )
        # 3) streams that reached the engine, then reset: their requests are aborted, their KV blocks freed
        async with raw_h2(server.port, ssl=client_ssl, metadata=metadata) as raw:
            stream_ids = [
                raw.start_call(GENERATE, _long_request(f"slow-{i}").SerializeToString()) for i in range(16)
            ]
            await raw.flush()
            # Every stream has produced tokens: all 16 requests are running in the engine.
            await raw.wait_until(
                lambda: len({e.stream_id for e in raw.events if isinstance(e, DataReceived)}) == 16
            )
            for stream_id in stream_ids:
                raw.conn.reset_stream(stream_id, error_code=ErrorCodes.CANCEL)
            await raw.flush()
            load = await _wait_engine_idle(stub)
            assert load.num_free_kv_blocks == load.num_total_kv_blocks
            assert raw.goaway is None
        # The server kept serving throughout.
        replies = await stub.Generate(
            generate_pb2.GenerateRequest(
                request_id="after",
                token_ids=generate_pb2.TokenIds(ids=[5, 6]),
                stopping=generate_pb2.StoppingCriteria(max_tokens=4, ignore_eos=True),
            ),
            metadata=AUTH,
            timeout=WAIT_S,
        )
        assert sum(len(c.token_ids) for r in replies for c in r.completions) == 4
    finally:
        channel.close()
