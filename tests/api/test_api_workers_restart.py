"""--api-workers: a worker process that dies is logged at ERROR, collected, replaced and counted in the
metrics (`engine_api_worker_restarts_total`); its successor serves, and no counter goes backwards."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from apiutil import CALL_TIMEOUT_S, completion_ids, greedy_request
from engine_proto.engine.v1 import info_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.client import Channel
from prometheus_client.parser import text_string_to_metric_families
from serverproc import RunningServer, connection_owner, start_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

RESTART_WITHIN_S = 60.0  # a worker imports the stack and loads the tokenizer (~1 s; two busy shared cores)
GENERATE_OK = ("engine_requests_total", (("code", "OK"), ("rpc", "Generate")))
RESTARTS = ("engine_api_worker_restarts_total", ())


def _scrape(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    assert server.metrics_port is not None
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=CALL_TIMEOUT_S) as response:
        body = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body) for sample in family.samples}


async def _generate_on(server: RunningServer, pid: int, *, within_s: float) -> None:
    """A Generate over a connection that frontend `pid` serves, once it serves: new connections until the
    kernel hands one to it while it says SERVING (a new worker listens before its engine is attached)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        channel = Channel("127.0.0.1", server.port)
        try:
            stub = EngineServiceStub(channel)
            load = await stub.GetLoad(info_pb2.GetLoadRequest(), timeout=CALL_TIMEOUT_S)
            if connection_owner(channel) == pid and load.state == info_pb2.ENGINE_STATE_SERVING:
                responses = await stub.Generate(greedy_request([5, 6], max_tokens=3), timeout=CALL_TIMEOUT_S)
                assert len(completion_ids(responses)) == 3
                return
        finally:
            channel.close()
        await asyncio.sleep(0.02)  # NOTE: polls another process's start, bounded by the deadline
    raise AssertionError(f"no connection reached frontend {pid} serving within {within_s} s")


async def test_a_killed_worker_is_logged_replaced_and_counted() -> None:
    with start_server("--api-workers", "2", "--metrics-port", "0") as server:
        (worker,) = server.pids_named("engine-api-1")
        await _generate_on(server, worker, within_s=CALL_TIMEOUT_S)
        before = await asyncio.to_thread(_scrape, server)
        assert before[RESTARTS] == 0
        assert before[GENERATE_OK] >= 1

        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + RESTART_WITHIN_S
        successors: list[int] = []
        while not successors:  # NOTE: polls another process's children, bounded by the deadline
            assert time.monotonic() < deadline, server.log()[-3000:]
            successors = [pid for pid in server.pids_named("engine-api-1") if pid != worker]
            await asyncio.sleep(0.05)
        await _generate_on(server, successors[0], within_s=RESTART_WITHIN_S)
        after = await asyncio.to_thread(_scrape, server)
        log = server.log()
        assert not Path(f"/proc/{worker}").exists()  # collected, not a zombie
    assert server.returncode == 0
    assert after[RESTARTS] == 1
    # The dead worker's counts stay in the sums (its last answer): one more Generate, none lost.
    assert after[GENERATE_OK] == before[GENERATE_OK] + 1
    assert f"ERROR engine_server.api.workers: api worker 1 (pid {worker}) was killed by SIGKILL" in log
    assert "api worker 1 serves again" in log
