"""FastSender (the streaming hot path) delivers exactly what grpclib's send_message would, in order: small
messages, messages larger than a frame, more data than the flow-control window, with a listener present."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from engine_proto.engine.v1 import generate_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceStub
from engine_server.api.fast_send import FastSender
from engine_server.api.security import build_server
from engine_server.api.security.config import SecurityConfig
from grpclib.client import Channel
from grpclib.const import Cardinality, Handler
from grpclib.events import SendMessage, listen

TIMEOUT = 30.0
# (number of token ids) per message: small ones, one over h2's 16 KiB frame size, then enough to pass 1 MiB.
SIZES = [1, 3, 1, 9000, 2, *([500] * 400), 1]


class _StreamingService:
    def __init__(self) -> None:
        self.fast_paths: list[bool] = []

    async def generate(self, stream: Any) -> None:
        await stream.recv_message()
        sender = FastSender(stream)
        self.fast_paths.append(sender._ok)
        for i, size in enumerate(SIZES):
            response = generate_pb2.GenerateResponse(request_id=f"m{i}")
            response.completions.add(index=0).token_ids.extend([i % 1000] * size)
            await sender.send(response)

    def __mapping__(self) -> dict[str, Handler]:
        return {"/engine.v1.EngineService/Generate": Handler(
            self.generate, Cardinality.UNARY_STREAM, generate_pb2.GenerateRequest,
            generate_pb2.GenerateResponse)}


@pytest.mark.parametrize("with_listener", [False, True])
async def test_fast_send_matches_the_protocol(with_listener: bool) -> None:
    service = _StreamingService()
    server = build_server([service], SecurityConfig())
    if with_listener:
        async def on_send(event: SendMessage) -> None:
            pass

        listen(server, SendMessage, on_send)
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    channel = Channel("127.0.0.1", port)
    try:
        async with asyncio.timeout(TIMEOUT):
            stub = EngineServiceStub(channel)
            for _ in range(2):  # two calls on one connection: windows are kept right across calls
                async with stub.Generate.open() as stream:
                    await stream.send_message(generate_pb2.GenerateRequest(), end=True)
                    received = [response async for response in stream]
                assert [r.request_id for r in received] == [f"m{i}" for i in range(len(SIZES))]
                assert [len(r.completions[0].token_ids) for r in received] == SIZES
                assert all(set(r.completions[0].token_ids) == {i % 1000} for i, r in enumerate(received))
        assert service.fast_paths == [not with_listener] * 2
    finally:
        channel.close()
        server.close()
        await asyncio.wait_for(server.wait_closed(), TIMEOUT)
