"""A CPU server never loads triton (GPU-only; engine/gpu_modules.py), in any of its processes, and its
shutdown prints no nanobind leak reports (triton's extension printed hundreds of lines at exit)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from apiutil import CALL_TIMEOUT_S, greedy_request
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.client import Channel
from serverproc import start_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""  # exited meanwhile (e.g. multiprocessing's resource tracker)


@pytest.mark.parametrize("mode", [(), ("--in-process-engine",)], ids=["core-process", "in-process-engine"])
async def test_a_cpu_server_never_loads_triton_and_stops_quietly(mode: tuple[str, ...]) -> None:
    server = start_server(*mode)
    channel = Channel("127.0.0.1", server.port)
    try:
        responses = await EngineServiceStub(channel).Generate(greedy_request([5, 6], max_tokens=4),
                                                              timeout=CALL_TIMEOUT_S)
        assert responses[-1].completions[0].finish_reason
        maps = {pid: _maps(pid) for pid in server.pids()}
    finally:
        channel.close()
        code = server.stop()
    assert code == 0
    # The engine's process (the control: it has torch, the only way to triton here) has no triton either.
    engine_pid = server.process.pid if mode else next(p for p, text in maps.items() if "libtorch" in text
                                                      and p != server.process.pid)
    assert "libtorch" in maps[engine_pid]
    assert [pid for pid, text in maps.items() if "triton" in text] == []
    noise = [line for line in server.log().splitlines() if "nanobind" in line or "leaked" in line]
    assert noise == []
