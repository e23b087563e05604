"""The real `engine-server` (tiny model) when its engine core dies (SIGKILL): the streams in flight end
UNAVAILABLE, then the server exits by itself with status 3 (api/runner.py's EXIT_ENGINE_FAILED) for its
supervisor to start a new one, with one frontend or with --api-workers (whose workers go too)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from apiutil import CALL_TIMEOUT_S, greedy_request
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_server.api.runner import EXIT_ENGINE_FAILED
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from serverproc import RunningServer, start_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

NUM_STREAMS = 4
EXIT_WITHIN_S = 20.0  # (it takes well under a second; two busy shared cores)


async def _open_endless(stub: EngineServiceStub, index: int) -> Any:
    """A Generate stream the server has admitted (its first message arrived)."""
    stream = stub.Generate.open(timeout=CALL_TIMEOUT_S)
    await stream.__aenter__()
    await stream.send_message(greedy_request([20, 21, 22, 23], max_tokens=1500, ignore_eos=True,
                                             request_id=f"doomed-{index}"), end=True)
    assert await stream.recv_message() is not None
    return stream


async def _status_at_end(stream: Any) -> Status:
    try:
        async for _ in stream:
            pass
        await stream.recv_trailing_metadata()
    except GRPCError as exc:
        return exc.status
    finally:
        await stream.__aexit__(None, None, None)
    return Status.OK


def _wait(server: RunningServer, timeout: float) -> int | None:
    try:
        return server.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.parametrize("mode", [(), ("--api-workers", "2")], ids=["one-frontend", "api-workers"])
async def test_an_engine_failure_ends_the_server_with_status_3(mode: tuple[str, ...]) -> None:
    # NOTE: a long drain timeout: the exit must not come from a drain running out
    server = start_server("--drain-timeout", "60", *mode)
    channel = Channel("127.0.0.1", server.port)
    try:
        stub = EngineServiceStub(channel)
        streams = [await _open_endless(stub, index) for index in range(NUM_STREAMS)]
        (core,) = server.pids_named("engine-core")
        workers = server.pids_named("engine-api-1")
        os.kill(core, signal.SIGKILL)
        async with asyncio.timeout(CALL_TIMEOUT_S):
            statuses = [await _status_at_end(stream) for stream in streams]
        code = await asyncio.to_thread(_wait, server, EXIT_WITHIN_S)
    finally:
        channel.close()
        if server.process.poll() is None:
            server.stop()
    assert statuses == [Status.UNAVAILABLE] * NUM_STREAMS
    log = server.log()
    assert code == EXIT_ENGINE_FAILED, log[-3000:]
    assert "engine core is gone (killed by SIGKILL)" in log
    assert f"the engine failed: stopping (exit status {EXIT_ENGINE_FAILED})" in log
    assert "Traceback" not in log, log[-3000:]
    for worker in workers:  # gone with the server, not replaced: the engine they shared is dead
        assert not Path(f"/proc/{worker}").exists() or _state(worker) == "Z"
    assert "serves again" not in log


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
