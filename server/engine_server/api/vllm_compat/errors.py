"""Engine exceptions -> gRPC status, for every RPC of this service (one place).

The same table as `engine_server.api.errors` (engine.v1), except that a RequestError's field name is left as
the engine names it (vllm_engine.proto's SamplingParams uses the same flat names), not mapped to engine.v1's
message paths.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from engine_server.frontend.types import EngineDead, EngineOverloaded, RequestError

logger = logging.getLogger(__name__)


@contextmanager
def grpc_status(rpc: str, request_id: str = "") -> Iterator[None]:
    """Re-raise what the engine raises as the GRPCError the contract names.

    RequestError -> INVALID_ARGUMENT, EngineOverloaded -> RESOURCE_EXHAUSTED, EngineDead -> UNAVAILABLE
    (the gateway then routes to another worker); anything else -> INTERNAL with a generic message and the
    traceback logged.
    NOTE: CancelledError is a BaseException and passes through untouched (cancellation must propagate).
    """
    try:
        yield
    except GRPCError:
        raise
    except RequestError as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from exc
    except EngineOverloaded as exc:
        raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from exc
    except EngineDead as exc:
        raise GRPCError(Status.UNAVAILABLE, str(exc)) from exc
    except Exception as exc:
        logger.exception("vllm.grpc.engine.VllmEngine/%s failed (request_id=%r)", rpc, request_id)
        raise GRPCError(Status.INTERNAL, "internal error; see the server log") from exc
