"""Bounded receive message size: grpclib reads whatever length prefix a client sends, so we check it first.

grpclib's `Stream.recv_message` reads the 5-byte gRPC prefix and then buffers (and acknowledges, so the
client may keep sending) the whole body, whatever its announced length. We swap, per call, the stream's
`recv_message` for one that rejects an oversized prefix with RESOURCE_EXHAUSTED before reading the body.
grpclib then sends the status and RST_STREAM(NO_ERROR); unread DATA is acknowledged on release, so the
connection's flow-control window is not leaked and the connection keeps serving.
"""

from __future__ import annotations

import struct
import time
from typing import Any

from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream

_PREFIX = struct.Struct(">?I")


async def _recv_bounded(stream: Stream[Any, Any], max_size: int) -> Any:
    # Mirrors grpclib.server.Stream.recv_message + grpclib.stream.recv_message (0.4.x) with the size check.
    h2_stream = stream._stream
    prefix = await h2_stream.recv_data(_PREFIX.size)
    if not prefix:
        return None
    is_compressed, length = _PREFIX.unpack(prefix)
    if is_compressed:
        raise GRPCError(Status.UNIMPLEMENTED, "compressed request messages are not supported")
    if length > max_size:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"received message larger than max ({length} vs. {max_size})",
        )
    body = await h2_stream.recv_data(length)
    if len(body) != length:
        raise GRPCError(Status.INTERNAL, "incomplete request message")
    message = stream._codec.decode(body, stream._recv_type)
    (message,) = await stream._dispatch.recv_message(message)
    stream._messages_received += 1
    h2_stream.connection.messages_received += 1
    h2_stream.connection.last_message_received = time.monotonic()
    return message


class MessageSizeLimit:
    """The RecvRequest listener: wraps the servicer method so its stream reads are bounded."""

    def __init__(self, max_receive_message_size: int) -> None:
        if max_receive_message_size < 1:
            raise ValueError(f"max_receive_message_size must be >= 1, got {max_receive_message_size}")
        self.max_receive_message_size = max_receive_message_size

    async def __call__(self, event: RecvRequest) -> None:
        method_func = event.method_func
        max_size = self.max_receive_message_size

        async def bounded_method(stream: Stream[Any, Any]) -> None:
            async def recv_message() -> Any:
                return await _recv_bounded(stream, max_size)

            # NOTE: an instance attribute shadows the method; `async for msg in stream` goes through it too.
            stream.recv_message = recv_message  # type: ignore[method-assign]
            await method_func(stream)

        event.method_func = bounded_method


def install_message_size_limit(server: Server, max_receive_message_size: int) -> MessageSizeLimit:
    listener = MessageSizeLimit(max_receive_message_size)
    listen(server, RecvRequest, listener)
    return listener
