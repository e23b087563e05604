"""LoRA adapters with --api-workers 2: one engine core serves both frontends, so an adapter loaded through
one frontend serves requests through the other, with its own tokens (the shared core's renamed requests
keep their adapter)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from apiutil import CALL_TIMEOUT_S, completion_ids, greedy_request
from engine_proto.engine.v1 import adapters_pb2, info_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_server.models.tiny import default_model_dir
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from lora_testutil import AdapterSpec, build_adapter, peft_greedy, peft_model
from serverproc import RunningServer, connection_owner, start_server

SPEC = AdapterSpec("w", 8, ("q_proj", "o_proj", "up_proj"), lora_alpha=16, seed=31)
PROMPT = [9, 99, 999, 19, 199, 29, 3, 33]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("workers-adapters")
    build_adapter(default_model_dir(), directory, SPEC)
    return directory


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[RunningServer]:
    with start_server("--api-workers", "2", "--adapter-dir", str(root), "--enable-adapter-admin") as running:
        yield running


async def _channel_to(server: RunningServer, pid: int) -> Channel:
    """A channel served by frontend `pid` once it serves (the kernel picks the frontend per connection)."""
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while time.monotonic() < deadline:
        channel = Channel("127.0.0.1", server.port)
        load = await EngineServiceStub(channel).GetLoad(info_pb2.GetLoadRequest(), timeout=CALL_TIMEOUT_S)
        if connection_owner(channel) == pid and load.state == info_pb2.ENGINE_STATE_SERVING:
            return channel
        channel.close()
        await asyncio.sleep(0.02)  # NOTE: polls another process's start, bounded by the deadline
    raise AssertionError(f"no connection reached frontend {pid} within {CALL_TIMEOUT_S} s")


async def _tokens(stub: EngineServiceStub, adapter: str) -> list[int]:
    request = greedy_request(PROMPT, max_tokens=8, ignore_eos=True)
    request.adapter = adapter
    return completion_ids(await stub.Generate(request, timeout=CALL_TIMEOUT_S))


async def test_an_adapter_loaded_through_one_frontend_serves_both(server: RunningServer, root: Path) -> None:
    (worker_pid,) = server.pids_named("engine-api-1")
    primary, worker = await _channel_to(server, server.process.pid), await _channel_to(server, worker_pid)
    try:
        on_primary, on_worker = EngineServiceStub(primary), EngineServiceStub(worker)
        await on_worker.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="w", path="w"),
                                    timeout=CALL_TIMEOUT_S)
        want = peft_greedy(peft_model(default_model_dir(), root / "w"), PROMPT, 8)
        assert await _tokens(on_primary, "w") == want
        assert await _tokens(on_worker, "w") == want
        assert await _tokens(on_worker, "") != want
        listed = await on_primary.ListAdapters(adapters_pb2.ListAdaptersRequest(), timeout=CALL_TIMEOUT_S)
        assert [a.name for a in listed.adapters] == ["w"]
        await on_primary.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="w"), timeout=CALL_TIMEOUT_S)
        with pytest.raises(GRPCError) as caught:
            await _tokens(on_worker, "w")
        assert caught.value.status is Status.INVALID_ARGUMENT
    finally:
        primary.close()
        worker.close()
