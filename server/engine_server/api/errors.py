"""Exceptions -> gRPC status, in one place.

RequestError -> INVALID_ARGUMENT (the message names the proto field); EngineOverloaded and server limits ->
RESOURCE_EXHAUSTED; EngineDead (starting, draining, failed, stopped) -> UNAVAILABLE; anything else -> INTERNAL
with a generic message, the traceback logged here with the request id.
"""

from __future__ import annotations

import logging

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from engine_server.api.convert import proto_field_name
from engine_server.frontend.adapter_types import (
    AdapterError,
    AdapterExists,
    AdapterInUse,
    AdapterNotFound,
    AdapterSlotsFull,
)
from engine_server.frontend.types import EngineDead, EngineOverloaded, RequestError

logger = logging.getLogger(__name__)


class ServerBusy(Exception):
    """A server-side admission limit (not the engine's) is full."""


class RequestFailed(Exception):
    """The engine failed one request mid-way (a chunk finished with FinishReason.ERROR)."""


def to_grpc_error(exc: Exception, *, rpc: str, request_id: str = "") -> GRPCError:
    """The status a client sees for `exc`; unexpected errors are logged with their traceback."""
    if isinstance(exc, GRPCError):
        return exc
    if isinstance(exc, RequestError):
        name = proto_field_name(exc.field_name)
        message = str(exc).removeprefix(f"{exc.field_name}: ")
        return GRPCError(Status.INVALID_ARGUMENT, f"{name}: {message}")
    if isinstance(exc, (EngineOverloaded, ServerBusy)):
        return GRPCError(Status.RESOURCE_EXHAUSTED, str(exc) or "the server is overloaded; retry later")
    if isinstance(exc, EngineDead):
        return GRPCError(Status.UNAVAILABLE, str(exc) or "the engine is unavailable")
    if isinstance(exc, AdapterError):
        return GRPCError(_adapter_status(exc), str(exc))
    logger.error("%s failed (request_id=%s)", rpc, request_id or "-", exc_info=exc)
    return GRPCError(Status.INTERNAL, "internal server error (details are in the server log)")


def _adapter_status(exc: AdapterError) -> Status:
    """A refused adapter operation (docs/adapters.md): a bad path, bad files, a rank or target the server
    cannot take are the caller's INVALID_ARGUMENT; the rest say what state refused it."""
    if isinstance(exc, AdapterNotFound):
        return Status.NOT_FOUND
    if isinstance(exc, AdapterExists):
        return Status.ALREADY_EXISTS
    if isinstance(exc, AdapterSlotsFull):
        return Status.RESOURCE_EXHAUSTED
    if isinstance(exc, AdapterInUse) or type(exc) is AdapterError:  # (the base: no LoRA, no adapter dir)
        return Status.FAILED_PRECONDITION
    return Status.INVALID_ARGUMENT
