"""grpc.health.v1 Check messages, built in a PRIVATE descriptor pool.

NOTE: grpclib's ``health_pb2`` and grpcio-health-checking's ``health_pb2`` both register the symbol
``grpc.health.v1.HealthCheckRequest`` in protobuf's default pool under different file names, so importing both
in one process fails. A library must not make its users' imports order-dependent: keep our copy private.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

from .types import HealthStatus

CHECK_METHOD = "/grpc.health.v1.Health/Check"
_STATUSES = (HealthStatus.UNKNOWN, HealthStatus.SERVING, HealthStatus.NOT_SERVING,
             HealthStatus.SERVICE_UNKNOWN)


class CheckRequest(Protocol):
    service: str

    def SerializeToString(self, **kwargs: bool) -> bytes: ...


class CheckResponse(Protocol):
    status: int


@dataclass(frozen=True, slots=True)
class HealthMessages:
    request_type: type[message.Message]
    response_type: type[message.Message]

    def request(self, service: str) -> message.Message:
        req = self.request_type()
        cast(CheckRequest, req).service = service
        return req

    @staticmethod
    def status(resp: message.Message) -> HealthStatus:
        value = cast(CheckResponse, resp).status
        return _STATUSES[value] if 0 <= value < len(_STATUSES) else HealthStatus.UNKNOWN


def build_health_messages() -> HealthMessages:
    fdp = descriptor_pb2.FileDescriptorProto(name="engine_client/health.proto", package="grpc.health.v1",
                                             syntax="proto3")
    req = fdp.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    resp = fdp.message_type.add(name="HealthCheckResponse")
    enum = resp.enum_type.add(name="ServingStatus")
    for number, name in enumerate(("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")):
        enum.value.add(name=name, number=number)
    resp.field.add(name="status", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_ENUM,
                   label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
                   type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return HealthMessages(
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")),
    )
