"""The test harness itself: servers started from a worker thread outlive it (PR_SET_PDEATHSIG follows the
thread that forked the child, so serverproc forks from one long-lived thread)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from grpclib.client import Channel
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from serverproc import RunningServer, start_servers

CALL_TIMEOUT_S = 30.0
SIGTERM_LINE = "SIGTERM: draining"


async def _health(server: RunningServer) -> int:
    channel = Channel("127.0.0.1", server.port)
    try:
        response = await HealthStub(channel).Check(HealthCheckRequest(), timeout=CALL_TIMEOUT_S)
        return int(response.status)
    finally:
        channel.close()


async def test_servers_started_together_from_a_finished_worker_thread_stay_alive() -> None:
    # Two servers started at once from a pool thread, each with its own extra args; the thread has exited
    # before anything is checked.
    with ThreadPoolExecutor(max_workers=1) as pool:
        servers = pool.submit(
            start_servers, 2, "--in-process-engine", per_server_args=[(), ("--metrics-port", "0")]
        ).result()
    try:
        assert len({server.port for server in servers}) == 2
        assert servers[0].metrics_port is None
        assert servers[1].metrics_port is not None
        for server in servers:
            # NOTE: a PDEATHSIG sent when the pool's thread exited would have flipped health to NOT_SERVING
            # before this call is served (the signal handler runs first on the server's loop).
            assert server.process.poll() is None, server.log()
            assert await _health(server) == HealthCheckResponse.SERVING
    finally:
        codes = [server.stop() for server in servers]
    assert codes == [0, 0]
    for server in servers:
        assert server.log().count(SIGTERM_LINE) == 1  # only stop()'s, none from the thread's exit
