"""A minimal grpclib client for vllm.grpc.engine.VllmEngine over smg-grpc-proto's `_pb2` (what smg speaks)."""

from __future__ import annotations

from typing import Any

from grpclib.client import Channel
from grpclib.const import Cardinality
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

PREFIX = "/vllm.grpc.engine.VllmEngine/"


async def read_all(stream: Any) -> list[Any]:
    messages = []
    while (message := await stream.recv_message()) is not None:
        messages.append(message)
    return messages


class VllmClient:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    async def unary(self, method: str, request: Any, reply_type: Any, *, time_limit: float = 10.0) -> Any:
        async with self.channel.request(PREFIX + method, Cardinality.UNARY_UNARY, type(request), reply_type,
                                        timeout=time_limit) as stream:
            await stream.send_message(request, end=True)
            reply = await stream.recv_message()
            await stream.recv_trailing_metadata()
            return reply

    def generate(self, request: Any, *, time_limit: float = 30.0) -> Any:
        """An open stream (async context manager); the caller sends the request and reads messages."""
        return self.channel.request(PREFIX + "Generate", Cardinality.UNARY_STREAM, pb.GenerateRequest,
                                    pb.GenerateResponse, timeout=time_limit)

    async def generate_all(self, request: Any, *, time_limit: float = 30.0) -> list[Any]:
        async with self.generate(request, time_limit=time_limit) as stream:
            await stream.send_message(request, end=True)
            return await read_all(stream)

    async def tokenizer_chunks(self, *, time_limit: float = 30.0) -> list[Any]:
        async with self.channel.request(PREFIX + "GetTokenizer", Cardinality.UNARY_STREAM,
                                        common_pb2.GetTokenizerRequest, common_pb2.GetTokenizerChunk,
                                        timeout=time_limit) as stream:
            await stream.send_message(common_pb2.GetTokenizerRequest(), end=True)
            return await read_all(stream)

    async def loads(self) -> Any:
        return await self.unary("GetLoads", pb.GetLoadsRequest(), pb.GetLoadsResponse)

    async def abort(self, *request_ids: str) -> None:
        await self.unary("Abort", pb.AbortRequest(request_ids=list(request_ids)), pb.AbortResponse)
