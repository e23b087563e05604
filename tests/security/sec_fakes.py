"""A tiny EngineService on a fake engine, served by build_server on loopback, for the security tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from ssl import SSLContext
from typing import Any

from engine_proto.engine.v1 import generate_pb2, tokenize_pb2
from engine_proto.engine.v1.engine_service_grpc import EngineServiceBase
from engine_server.api.security import GuardedServer, SecurityConfig, build_server
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.health.service import Health
from grpclib.server import Stream

WAIT_S = 10.0  # bound of every wait in these tests


@dataclass(slots=True)
class FakeEngine:
    """Counts requests like the real engine would: started, running, aborted."""

    num_started: int = 0
    num_aborted: int = 0
    num_running: int = 0  # counts requests even when they share an id
    running: set[str] = field(default_factory=set)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_for(self, predicate: Any) -> None:
        async with asyncio.timeout(WAIT_S), self.changed:
            await self.changed.wait_for(predicate)

    async def generate(self, request_id: str, num_tokens: int) -> AsyncGenerator[int, None]:
        self.num_started += 1
        self.num_running += 1
        self.running.add(request_id)
        await self._notify()
        try:
            for token_id in range(num_tokens):
                yield token_id
                await asyncio.sleep(0)  # NOTE: a decode step; lets other tasks run, not synchronisation
            if num_tokens < 0:  # "never finish": the request runs until it is aborted
                await asyncio.Event().wait()
        except (asyncio.CancelledError, GeneratorExit):
            self.num_aborted += 1
            raise
        finally:
            self.num_running -= 1
            self.running.discard(request_id)
            # A finally may not await in a closed generator; schedule the notification instead.
            asyncio.get_running_loop().create_task(self._notify())


class FakeEngineService(EngineServiceBase):
    """Tokenize echoes one id per character; Generate streams max_tokens ids (0: forever)."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    async def Tokenize(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        assert request is not None
        await stream.send_message(
            tokenize_pb2.TokenizeResponse(token_ids=[ord(c) for c in request.text[:64]])
        )

    async def Generate(self, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        assert request is not None
        num_tokens = request.stopping.max_tokens if request.stopping.HasField("max_tokens") else -1
        responses = self.engine.generate(request.request_id, num_tokens)
        try:
            async for token_id in responses:
                chunk = generate_pb2.CompletionChunk(token_ids=[token_id])
                await stream.send_message(
                    generate_pb2.GenerateResponse(request_id=request.request_id, completions=[chunk])
                )
        finally:
            await responses.aclose()

    async def _unimplemented(self, stream: Stream[Any, Any]) -> None:
        raise GRPCError(Status.UNIMPLEMENTED)

    Embed = Detokenize = Abort = GetModelInfo = GetServerInfo = GetLoad = _unimplemented
    FlushCache = SubscribeCacheEvents = _unimplemented
    LoadAdapter = UnloadAdapter = ListAdapters = _unimplemented


@dataclass(slots=True)
class Served:
    server: GuardedServer
    engine: FakeEngine
    port: int


@contextlib.asynccontextmanager
async def serve(config: SecurityConfig, *, ssl: SSLContext | None = None) -> AsyncIterator[Served]:
    """Serve the fake on loopback; `ssl` overrides the context built from `config`."""
    engine = FakeEngine()
    server = build_server([FakeEngineService(engine), Health()], config)
    await server.start("127.0.0.1", 0, ssl=ssl if ssl is not None else config.server_ssl_context())
    try:
        sockets = getattr(server._server, "sockets", None)  # asyncio.Server and uvloop's Server
        assert sockets
        port = sockets[0].getsockname()[1]
        yield Served(server, engine, port)
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT_S)
