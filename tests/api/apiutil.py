"""Request builders and waits shared by the api tests (real generated clients: grpclib stubs over `_pb2`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine_proto.engine.v1 import generate_pb2, info_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from grpclib.client import Channel
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest

if TYPE_CHECKING:
    from engine_server.api.server import EngineServer
    from fakes import FakeEngine

CALL_TIMEOUT_S = 60.0  # every RPC of the tests carries a deadline


class Harness:
    """An in-process EngineServer (api/server.py) on a fake engine, with a channel and stubs to it."""

    def __init__(self, server: EngineServer, engine: FakeEngine) -> None:
        self.server = server
        self.engine = engine
        self.channel = Channel("127.0.0.1", server.port)
        self.stub = EngineServiceStub(self.channel)
        self.health = HealthStub(self.channel)

    async def health_status(self, service: str = "") -> int:
        response = await self.health.Check(HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S)
        return int(response.status)


def greedy_request(
    prompt_ids: Sequence[int] = (),
    *,
    text: str | None = None,
    max_tokens: int = 16,
    stream: bool = True,
    request_id: str = "",
    ignore_eos: bool = False,
) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(request_id=request_id, stream=stream)
    if text is not None:
        request.text = text
    else:
        request.token_ids.ids.extend(prompt_ids)
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = ignore_eos
    return request


def completion_ids(responses: Sequence[generate_pb2.GenerateResponse], index: int = 0) -> list[int]:
    return [t for r in responses for c in r.completions if c.index == index for t in c.token_ids]


def completion_text(responses: Sequence[generate_pb2.GenerateResponse], index: int = 0) -> str:
    return "".join(c.text for r in responses for c in r.completions if c.index == index)


def finish_reasons(responses: Sequence[generate_pb2.GenerateResponse]) -> dict[int, int]:
    return {c.index: c.finish_reason for r in responses for c in r.completions if c.finish_reason}


async def wait_engine_idle(stub: EngineServiceStub, *, within_s: float = 30.0) -> info_pb2.Load:
    """Until nothing runs or waits and every KV block is free; bounded. Returns the last load."""
    deadline = time.monotonic() + within_s
    while True:
        load = (await stub.GetLoad(info_pb2.GetLoadRequest(), timeout=CALL_TIMEOUT_S)).load
        idle = load.num_running_requests == 0 and load.num_waiting_requests == 0
        if idle and load.num_free_kv_blocks == load.num_total_kv_blocks:
            return load
        if time.monotonic() > deadline:
            return load
        # NOTE: aborts reach the engine core asynchronously (RST_STREAM -> handler cancelled -> abort
        # command -> next core step); poll the public load until it settles, within the bound.
        await asyncio.sleep(0.05)
