"""GOAWAY on drain: which clients may get an early notice while their streams still run, and that notice.

RFC 9113 section 6.8 lets a server send GOAWAY(last_stream_id = 2^31-1) first ("open no more streams") and a
final GOAWAY with the real last stream id once its streams are done; grpc-go and hyper/h2 servers drain that
way, and grpc-core, grpc-go, grpc-java and tonic clients keep their open streams through the first one. Not
every client does: grpclib's (our `engine_client.aio`) ends every open stream on any GOAWAY. So only clients
whose user-agent names an implementation known to keep its streams get the early notice; every other
connection gets a GOAWAY only once it has no stream left (h2_guard.GuardedH2Protocol.begin_drain), and not
right away: grpclib's client ends a stream on GOAWAY even when every byte of it has arrived but the caller
has not read it all yet (the trailers and a GOAWAY read together kill the call), so those connections get it
once they have had no stream open for `GOAWAY_LINGER_S`.

The early notice is written as raw bytes, not through h2: h2's `close_connection` moves its state machine to
CLOSED, after which it refuses every frame on the streams that must still finish.
"""

from __future__ import annotations

import struct
import time

from h2.errors import ErrorCodes

MAX_STREAM_ID = 2**31 - 1
# Time a client gets to read a finished call before the GOAWAY: a caller iterating a stream reads its last
# messages and trailers within milliseconds; a drain lasts seconds, so waiting costs nothing.
GOAWAY_LINGER_S = 1.0
_GOAWAY_FRAME_TYPE = 0x7

# User-agent tokens of clients that keep streams at or below last_stream_id open after a GOAWAY (grpc-core
# names itself "grpc-c/" after the wrapping language: grpc-python, grpc-c++, grpc-ruby, ...; tonic appends
# "tonic/" to a custom user-agent, grpc-go appends "grpc-go/").
_EARLY_GOAWAY_TOKENS = ("grpc-c/", "grpc-go/", "grpc-java-", "grpc-dotnet/", "tonic/")


def keeps_streams_on_goaway(user_agent: str | None) -> bool:
    """Whether a client with this user-agent finishes its open streams after GOAWAY(2^31-1)."""
    if not user_agent:
        return False
    lowered = user_agent.lower()
    return any(token in lowered for token in _EARLY_GOAWAY_TOKENS)


def drain_goaway_delay_s(
    user_agent: str | None, *, last_stream_end: float | None, now: float | None = None
) -> float:
    """Seconds to wait before a connection with no stream open gets its final GOAWAY (0: now)."""
    if last_stream_end is None or keeps_streams_on_goaway(user_agent):
        return 0.0
    now = time.monotonic() if now is None else now
    return max(0.0, last_stream_end + GOAWAY_LINGER_S - now)


def early_goaway_frame(debug_data: bytes = b"draining") -> bytes:
    """GOAWAY(NO_ERROR, last_stream_id = 2^31-1): 'open no new stream here; the open ones go on'."""
    payload = struct.pack(">II", MAX_STREAM_ID, ErrorCodes.NO_ERROR) + debug_data
    # Frame header: 24-bit length, type, flags, 31-bit stream id (0: the connection).
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", _GOAWAY_FRAME_TYPE, 0, 0) + payload
