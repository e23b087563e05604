"""The test harness itself: servers started from worker threads outlive those threads (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from grpclib.client import Channel
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from serverproc import RunningServer, start_server, start_servers

CALL_TIMEOUT_S = 30.0
SIGTERM_LINE = "SIGTERM: draining"


async def _health(server: RunningServer) -> int:
    channel = Channel("127.0.0.1", server.port)
    try:
        response = await HealthStub(channel).Check(HealthCheckRequest(), timeout=CALL_TIMEOUT_S)
        return int(response.status)
    finally:
        channel.close()


async def test_servers_started_from_finished_worker_threads_stay_alive() -> None:
    # Two servers started concurrently, each from its own pool thread; the threads exit before any check.
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(start_server, "--in-process-engine") for _ in range(2)]
        servers = [future.result() for future in futures]
    try:
        for server in servers:
            # NOTE: a PDEATHSIG sent when the pool's threads exited would have flipped health to NOT_SERVING
            # before this call is served (the signal handler runs first on the server's loop).
            assert server.process.poll() is None, server.log()
            assert await _health(server) == HealthCheckResponse.SERVING
    finally:
        codes = [server.stop() for server in servers]
    assert codes == [0, 0]
    for server in servers:
        assert server.log().count(SIGTERM_LINE) == 1  # only stop()'s, none from a thread's exit


async def test_start_servers_starts_all_with_their_own_args() -> None:
    servers = await asyncio.to_thread(
        start_servers, 2, "--in-process-engine", per_server_args=[(), ("--metrics-port", "0")]
    )
    try:
        assert len({server.port for server in servers}) == 2
        assert servers[0].metrics_port is None
        assert servers[1].metrics_port is not None
        for server in servers:
            assert await _health(server) == HealthCheckResponse.SERVING
    finally:
        codes = [server.stop() for server in servers]
    assert codes == [0, 0]
