"""Standard tools against the server (grpcurl through reflection, grpc-health-probe) and SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path

import pytest
from apiutil import CALL_TIMEOUT_S, completion_ids, finish_reasons, greedy_request
from engine_proto.engine.v1 import generate_pb2, info_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from serverproc import RunningServer, start_server

GO_BIN = Path(__file__).resolve().parents[2] / ".tools" / "go" / "bin"
GRPCURL = GO_BIN / "grpcurl"
PROBE = GO_BIN / "grpc-health-probe"
needs_go_tools = pytest.mark.skipif(
    not (GRPCURL.exists() and PROBE.exists()),
    reason="grpcurl / grpc-health-probe missing: scripts/bootstrap.sh go",
)
TOOL_TIMEOUT_S = 30.0


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)


def _probe(target: str, service: str = "") -> subprocess.CompletedProcess[str]:
    return _run(PROBE, "-addr", target, "-service", service, "-connect-timeout", "10s", "-rpc-timeout", "10s")


@needs_go_tools
def test_grpcurl_lists_describes_and_calls(server: RunningServer) -> None:
    listed = _run(GRPCURL, "-plaintext", server.target, "list")
    assert listed.returncode == 0, listed.stderr
    services = listed.stdout.split()
    assert "engine.v1.EngineService" in services
    assert "grpc.health.v1.Health" in services
    described = _run(GRPCURL, "-plaintext", server.target, "describe", "engine.v1.EngineService")
    assert described.returncode == 0, described.stderr
    for rpc in (
        "Generate",
        "Embed",
        "Tokenize",
        "Detokenize",
        "Abort",
        "GetModelInfo",
        "GetServerInfo",
        "GetLoad",
    ):
        assert f"rpc {rpc}" in described.stdout
    called = _run(GRPCURL, "-plaintext", server.target, "engine.v1.EngineService/GetModelInfo")
    assert called.returncode == 0, called.stderr
    assert json.loads(called.stdout)["task"] == "MODEL_TASK_GENERATE"
    generated = _run(
        GRPCURL,
        "-plaintext",
        "-d",
        '{"text": "hi", "stopping": {"max_tokens": 3, "ignore_eos": true}}',
        server.target,
        "engine.v1.EngineService/Generate",
    )
    assert generated.returncode == 0, generated.stderr
    assert json.loads(generated.stdout)["usage"]["completionTokens"] == 3


@needs_go_tools
def test_health_probe_reports_serving(server: RunningServer) -> None:
    for service in ("", "engine.v1.EngineService"):
        probe = _probe(server.target, service)
        assert probe.returncode == 0, probe.stdout + probe.stderr
        assert "status: SERVING" in probe.stdout + probe.stderr


async def _health(channel: Channel) -> int:
    response = await HealthStub(channel).Check(HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S)
    return int(response.status)


@needs_go_tools
async def test_sigterm_drains_then_exits_zero() -> None:
    """In-flight streams finish within the drain timeout, longer ones are aborted, health is NOT_SERVING."""
    running = await asyncio.to_thread(start_server, "--in-process-engine", "--drain-timeout", "10")
    with running:
        channel = Channel("127.0.0.1", running.port)
        stub = EngineServiceStub(channel)
        try:
            short = greedy_request(text="short one", max_tokens=20, ignore_eos=True)
            long = greedy_request(text="long one", max_tokens=2000, ignore_eos=True)
            calls = [stub.Generate.open(timeout=120.0) for _ in range(2)]
            results: list[list[generate_pb2.GenerateResponse]] = []
            for call, request in zip(calls, (short, long), strict=True):
                await call.__aenter__()
                await call.send_message(request, end=True)
                first = await call.recv_message()
                assert first is not None  # admitted and streaming
                results.append([first])

            running.send_signal(signal.SIGTERM)
            # The signal is handled asynchronously: wait (bounded) for health to flip.
            for _ in range(200):
                if await _health(channel) == HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.05)
            probe = await asyncio.to_thread(_probe, running.target)
            assert probe.returncode != 0
            assert "NOT_SERVING" in probe.stdout + probe.stderr
            load = await stub.GetLoad(info_pb2.GetLoadRequest(), timeout=CALL_TIMEOUT_S)
            assert load.state == info_pb2.ENGINE_STATE_DRAINING
            with pytest.raises(GRPCError) as refused:
                await stub.Generate(greedy_request(text="too late", max_tokens=2), timeout=CALL_TIMEOUT_S)
            assert refused.value.status == Status.UNAVAILABLE

            for call, received in zip(calls, results, strict=True):
                received.extend([message async for message in call])  # status OK, else GRPCError
                await call.__aexit__(None, None, None)
        finally:
            channel.close()
        assert finish_reasons(results[0]) == {0: generate_pb2.FINISH_REASON_LENGTH}
        assert len(completion_ids(results[0])) == 20
        # The long stream was still running at the drain timeout: aborted, and the stream ended cleanly.
        assert finish_reasons(results[1]) in (
            {0: generate_pb2.FINISH_REASON_ABORT},
            {0: generate_pb2.FINISH_REASON_LENGTH},
        )
        assert results[1][-1].HasField("usage")
        assert await asyncio.to_thread(running.wait, 60.0) == 0


@pytest.mark.slow  # its own server start (tens of seconds on two shared cores)
async def test_second_signal_stops_at_once() -> None:
    running = await asyncio.to_thread(start_server, "--in-process-engine", "--drain-timeout", "300")
    with running:
        channel = Channel("127.0.0.1", running.port)
        try:
            call = EngineServiceStub(channel).Generate.open(timeout=120.0)
            await call.__aenter__()  # NOTE: never exited: the server dies under it
            await call.send_message(greedy_request(text="x", max_tokens=2000, ignore_eos=True), end=True)
            assert await call.recv_message() is not None
            running.send_signal(signal.SIGTERM)
            for _ in range(200):  # until the first signal was handled (health flipped)
                if await _health(channel) == HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.05)
            running.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(running.wait, 30.0)  # far less than the 300 s drain timeout
        finally:
            channel.close()
    assert code == 1
