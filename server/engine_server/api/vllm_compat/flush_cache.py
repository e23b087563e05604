"""The vLLM-compatible FlushCache: smg's `FlushCacheRequest.timeout_s` on an engine that never waits for idle.

smg-grpc-proto's FlushCache waits up to `timeout_s` for the scheduler to go idle, then flushes (0: at once,
failing while requests are in flight). Our engine flushes with requests in flight (running requests keep
their blocks, which stop being reusable: block_manager.py), so there is no idle to wait for: the flush is
applied at the core's next step boundary, and `timeout_s` only bounds how long the call waits for that.
  timeout_s = 0   wait for the flush (the call's deadline bounds it); success = true.
  timeout_s > 0   success = false, with a message, if the core did not apply it in time (it still will: the
                  command is on its way; a retry is harmless).
  negative, NaN or infinite: INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import math
from typing import Protocol

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from smg_grpc_proto.generated import common_pb2


class FlushingEngine(Protocol):
    async def flush_cache(self) -> int: ...


async def flush_cache(engine: FlushingEngine, timeout_s: float) -> common_pb2.FlushCacheResponse:
    if not math.isfinite(timeout_s) or timeout_s < 0:
        raise GRPCError(Status.INVALID_ARGUMENT, f"timeout_s: must be a finite number >= 0, got {timeout_s}")
    flush = engine.flush_cache()
    if timeout_s == 0:
        num_flushed = await flush
    else:
        try:
            num_flushed = await asyncio.wait_for(flush, timeout_s)
        except TimeoutError:
            return common_pb2.FlushCacheResponse(
                success=False,
                message=f"FlushCache did not complete within {timeout_s:g} s; the engine applies it at its "
                        "next step boundary",
            )
    return common_pb2.FlushCacheResponse(success=True, message=f"flushed {num_flushed} cached KV blocks")
