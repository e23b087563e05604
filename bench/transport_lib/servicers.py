"""The transport benchmark's three servers, each on the SAME `AsyncEngine` (Generate only for b and c).

(a) "grpclib-pb2": the shipped `EngineServicer` (api/servicer.py) in the shipped grpclib server
    (`build_server`: h2 guard, batched writes): what `engine-server` serves, without server.py's life cycle.
(b) "grpclib-bp2": a grpclib servicer over the betterproto2 dataclasses, the same grpclib server; a minimal,
    straightforward conversion (token ids, greedy/temperature, max_tokens, ignore_eos) in and out.
(c) "grpcio-pb2": a grpcio.aio servicer on the upb `_pb2` messages, reusing `convert`/`responses` as (a) does.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from engine_proto.betterproto.engine import v1 as bp2
from engine_proto.engine.v1 import engine_service_pb2_grpc, generate_pb2, info_pb2
from engine_server.api import convert, responses
from engine_server.api.security import SecurityConfig, build_server
from engine_server.api.servicer import EngineServicer
from engine_server.engine.types import FinishReason, SamplingParams
from engine_server.frontend.async_engine import AsyncEngine
from engine_server.frontend.outputs import GenerateRequest

TRANSPORTS = ("grpclib-pb2", "grpclib-bp2", "grpcio-pb2")
MAX_STREAMS = 4096
Stop = Callable[[], Awaitable[None]]

_BP2_FINISH = {
    FinishReason.STOP: bp2.FinishReason.STOP,
    FinishReason.LENGTH: bp2.FinishReason.LENGTH,
    FinishReason.ABORT: bp2.FinishReason.ABORT,
}


class BetterprotoServicer(bp2.EngineServiceBase):
    """Generate only: betterproto2 request -> engine request; engine outputs -> betterproto2 responses."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def generate(self, message: bp2.GenerateRequest) -> AsyncIterator[bp2.GenerateResponse]:
        sampling = message.sampling or bp2.SamplingParams()
        stopping = message.stopping or bp2.StoppingCriteria()
        params = SamplingParams(
            temperature=sampling.temperature if sampling.temperature is not None else 1.0,
            max_tokens=stopping.max_tokens, ignore_eos=stopping.ignore_eos,
        )
        ids = message.token_ids.ids if message.token_ids is not None else []
        request = GenerateRequest(message.request_id, tuple(ids), params)
        totals = 0
        async with contextlib.aclosing(self._engine.generate(request)) as outputs:
            async for output in outputs:
                completions = []
                for chunk in output.chunks:
                    totals = chunk.num_completion_tokens
                    completions.append(bp2.CompletionChunk(
                        index=chunk.index, text=chunk.text, token_ids=list(chunk.token_ids),
                        finish_reason=_BP2_FINISH.get(chunk.finish_reason, bp2.FinishReason.UNSPECIFIED)
                        if chunk.finish_reason is not None else bp2.FinishReason.UNSPECIFIED,
                    ))
                response = bp2.GenerateResponse(request_id=output.request_id, completions=completions)
                if output.finished:
                    response.usage = bp2.Usage(prompt_tokens=output.num_prompt_tokens,
                                               completion_tokens=totals)
                yield response


class GrpcioServicer(engine_service_pb2_grpc.EngineServiceServicer):
    """Generate only, on grpcio.aio: the same `convert`/`responses` functions as the shipped servicer."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        engine_request = convert.to_generate_request(
            request, tokenizer=self._engine.tokenizer, model_info=self._engine.model_info)
        counts = [0] * engine_request.params.n
        async with contextlib.aclosing(self._engine.generate(engine_request)) as outputs:
            async for output in outputs:
                yield responses.streaming_response(output, counts)


async def start_transport(kind: str, engine: AsyncEngine, *, host: str = "127.0.0.1",
                          port: int = 0) -> tuple[int, Stop]:
    """Serves `engine` over transport `kind`; returns the bound port and a coroutine function stopping it."""
    if kind == "grpcio-pb2":
        import grpc

        server = grpc.aio.server(options=[("grpc.max_concurrent_streams", MAX_STREAMS)])
        # NOTE: abstract for mypy only (the other RPCs): the generated base answers them UNIMPLEMENTED.
        grpcio_servicer = GrpcioServicer(engine)  # type: ignore[abstract]
        engine_service_pb2_grpc.add_EngineServiceServicer_to_server(grpcio_servicer, server)
        grpcio_port: int = server.add_insecure_port(f"{host}:{port}")
        await server.start()

        async def stop_grpcio() -> None:
            await server.stop(grace=None)

        return grpcio_port, stop_grpcio
    if kind == "grpclib-pb2":
        servicer = EngineServicer(served_model_name="tiny", max_concurrent_streams=MAX_STREAMS)
        servicer.attach(engine, limits=info_pb2.ServerLimits())
        servicer.set_ready()
        handler: Any = servicer
    elif kind == "grpclib-bp2":
        handler = BetterprotoServicer(engine)
    else:
        raise ValueError(f"transport: expected one of {TRANSPORTS}, got {kind!r}")
    grpclib_server = build_server([handler], SecurityConfig())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound: int = sock.getsockname()[1]
    await grpclib_server.start(sock=sock)

    async def stop_grpclib() -> None:
        grpclib_server.close()
        await grpclib_server.wait_closed()

    return bound, stop_grpclib
