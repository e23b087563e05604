"""The grpclib handler table of `vllm.grpc.engine.VllmEngine`, over smg-grpc-proto's `_pb2` messages.

smg-grpc-proto ships grpcio stubs only; grpclib needs `__mapping__` (path -> Handler), written here by hand
from `smg_grpc_proto/proto/vllm_engine.proto`. Every RPC of the service is listed: the ones this engine
cannot serve (profiling) answer UNIMPLEMENTED, which the gateway tolerates.
"""

from __future__ import annotations

import abc
from typing import Any

from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.server import Stream
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

SERVICE_NAME = "vllm.grpc.engine.VllmEngine"

# (method, cardinality, request type, reply type), in the .proto's order.
_METHODS: tuple[tuple[str, Cardinality, Any, Any], ...] = (
    ("Generate", Cardinality.UNARY_STREAM, pb.GenerateRequest, pb.GenerateResponse),
    ("Embed", Cardinality.UNARY_UNARY, pb.EmbedRequest, pb.EmbedResponse),
    ("HealthCheck", Cardinality.UNARY_UNARY, pb.HealthCheckRequest, pb.HealthCheckResponse),
    ("FlushCache", Cardinality.UNARY_UNARY, common_pb2.FlushCacheRequest, common_pb2.FlushCacheResponse),
    ("StartProfile", Cardinality.UNARY_UNARY, common_pb2.StartProfileRequest, common_pb2.ProfileResponse),
    ("StopProfile", Cardinality.UNARY_UNARY, common_pb2.StopProfileRequest, common_pb2.ProfileResponse),
    ("Abort", Cardinality.UNARY_UNARY, pb.AbortRequest, pb.AbortResponse),
    ("GetModelInfo", Cardinality.UNARY_UNARY, pb.GetModelInfoRequest, pb.GetModelInfoResponse),
    ("GetServerInfo", Cardinality.UNARY_UNARY, pb.GetServerInfoRequest, pb.GetServerInfoResponse),
    ("GetLoads", Cardinality.UNARY_UNARY, pb.GetLoadsRequest, pb.GetLoadsResponse),
    ("GetTokenizer", Cardinality.UNARY_STREAM, common_pb2.GetTokenizerRequest, common_pb2.GetTokenizerChunk),
    ("SubscribeKvEvents", Cardinality.UNARY_STREAM, common_pb2.SubscribeKvEventsRequest,
     common_pb2.KvEventBatch),
)

RpcStream = Stream[Any, Any]


class VllmEngineBase(abc.ABC):
    """Subclasses implement the RPCs the gateway uses; the optional ones default to UNIMPLEMENTED."""

    @abc.abstractmethod
    async def Generate(self, stream: RpcStream) -> None: ...

    @abc.abstractmethod
    async def Embed(self, stream: RpcStream) -> None: ...

    @abc.abstractmethod
    async def HealthCheck(self, stream: RpcStream) -> None: ...

    @abc.abstractmethod
    async def Abort(self, stream: RpcStream) -> None: ...

    @abc.abstractmethod
    async def GetModelInfo(self, stream: RpcStream) -> None: ...

    @abc.abstractmethod
    async def GetServerInfo(self, stream: RpcStream) -> None: ...

    @abc.abstractmethod
    async def GetLoads(self, stream: RpcStream) -> None: ...

    @abc.abstractmethod
    async def GetTokenizer(self, stream: RpcStream) -> None: ...

    @abc.abstractmethod
    async def FlushCache(self, stream: RpcStream) -> None: ...

    async def StartProfile(self, stream: RpcStream) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, "profiling is not supported by this engine")

    async def StopProfile(self, stream: RpcStream) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, "profiling is not supported by this engine")

    @abc.abstractmethod
    async def SubscribeKvEvents(self, stream: RpcStream) -> None: ...

    def __mapping__(self) -> dict[str, Handler]:
        return {
            f"/{SERVICE_NAME}/{name}": Handler(getattr(self, name), cardinality, request_type, reply_type)
            for name, cardinality, request_type, reply_type in _METHODS
        }
