"""Bounded receive message size: grpclib reads whatever length prefix a client sends, so we check it first.

grpclib's `Stream.recv_message` reads the 5-byte gRPC prefix and then buffers (and acknowledges, so the
client may keep sending) the whole body, whatever its announced length. We swap, per call, the stream's
`recv_message` for one that rejects an oversized prefix with RESOURCE_EXHAUSTED before reading the body.
grpclib then sends the status and RST_STREAM(NO_ERROR); unread DATA is acknowledged on release, so the
connection's flow-control window is not leaked and the connection keeps serving.

The same wrapper bounds how long a call with a single request message may take to deliver it
(`receive_timeout_s`, DEADLINE_EXCEEDED): otherwise a client could park handlers by sending headers only.
A stream that ends without that message is INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

from google.protobuf.message import DecodeError
from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream

from engine_server.api.security.oneofs import oneof_conflict

MESSAGE_PREFIX = struct.Struct(">?I")  # gRPC's 5-byte message prefix: compressed flag, length


def _type_name(message_type: Any) -> str:
    descriptor = getattr(message_type, "DESCRIPTOR", None)
    if descriptor is not None:
        return str(descriptor.full_name)
    return str(getattr(message_type, "__name__", "message"))


async def _recv_exactly(h2_stream: Any, size: int, what: str) -> bytes:
    """`size` bytes of the request stream, or b"" at its end before any.

    NOTE: grpclib's buffer signals a stream that ends part-way with AssertionError: left alone, that is
    UNKNOWN to the client and a traceback in the log, for a client's malformed request.
    """
    try:
        data: bytes = await h2_stream.recv_data(size)
    except AssertionError:
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"incomplete request message: the stream ended inside {what}"
        ) from None
    return data


async def _recv_bounded(stream: Stream[Any, Any], max_size: int) -> Any:
    # Mirrors grpclib.server.Stream.recv_message + grpclib.stream.recv_message (0.4.x) with the size check.
    h2_stream = stream._stream
    prefix = await _recv_exactly(h2_stream, MESSAGE_PREFIX.size, "a message's 5-byte prefix")
    if not prefix:
        return None
    is_compressed, length = MESSAGE_PREFIX.unpack(prefix)
    if is_compressed:
        raise GRPCError(Status.UNIMPLEMENTED, "compressed request messages are not supported")
    if length > max_size:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"received message larger than max ({length} vs. {max_size})",
        )
    body = await _recv_exactly(h2_stream, length, f"a {length}-byte message")
    (message,) = await stream._dispatch.recv_message(decode_received(stream, body))
    return message


def decode_received(stream: Stream[Any, Any], body: bytes) -> Any:
    """A received message's body decoded, counted on the call and its connection as grpclib counts it.

    Bytes that do not parse as the method's request type are the client's error: INVALID_ARGUMENT (grpclib
    would let the codec's exception escape the handler: UNKNOWN, and a traceback in the log per request).
    """
    try:
        message = stream._codec.decode(body, stream._recv_type)
    except DecodeError as error:
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"the request is not a valid {_type_name(stream._recv_type)}: {error}"
        ) from None
    conflict = oneof_conflict(message, body)
    if conflict is not None:
        raise GRPCError(Status.INVALID_ARGUMENT, conflict)
    count_received(stream)
    return message


def count_received(stream: Stream[Any, Any]) -> None:
    """A message received on the call, counted on it and its connection as grpclib counts it."""
    stream._messages_received += 1
    connection = stream._stream.connection
    connection.messages_received += 1
    connection.last_message_received = time.monotonic()


async def _recv_first_in_time(stream: Stream[Any, Any], max_size: int, timeout_s: float) -> Any:
    if getattr(stream._stream.buffer, "_eof", False):
        # The client half-closed the stream: everything it will send is buffered, so reading cannot wait
        # (the common case: HEADERS and DATA+END_STREAM arrive together), and a timer is not worth arming.
        return await _recv_bounded(stream, max_size)
    try:
        async with asyncio.timeout(timeout_s):
            return await _recv_bounded(stream, max_size)
    except TimeoutError:
        raise GRPCError(
            Status.DEADLINE_EXCEEDED, f"request message not received within {timeout_s:g} s"
        ) from None


class MessageSizeLimit:
    """The RecvRequest listener: wraps the servicer method so its stream reads are bounded."""

    def __init__(self, max_receive_message_size: int, *, receive_timeout_s: float | None = None) -> None:
        if max_receive_message_size < 1:
            raise ValueError(f"max_receive_message_size must be >= 1, got {max_receive_message_size}")
        if receive_timeout_s is not None and not receive_timeout_s > 0:
            raise ValueError(f"receive_timeout_s must be positive, got {receive_timeout_s}")
        self.max_receive_message_size = max_receive_message_size
        self.receive_timeout_s = receive_timeout_s

    async def __call__(self, event: RecvRequest) -> None:
        event.method_func = self.wrap_method(event.method_func)

    def wrap_method(self, method_func: Any) -> Any:
        """`method_func` with its stream's reads bounded: what the listener makes of every call's method
        (api/transport/fast_path.py applies it to the calls it serves itself)."""
        max_size = self.max_receive_message_size
        timeout_s = self.receive_timeout_s

        async def bounded_method(stream: Stream[Any, Any]) -> None:
            is_first = [not stream._cardinality.client_streaming]

            async def recv_message() -> Any:
                if not is_first[0]:
                    return await _recv_bounded(stream, max_size)
                is_first[0] = False
                if timeout_s is None:
                    message = await _recv_bounded(stream, max_size)
                else:
                    message = await _recv_first_in_time(stream, max_size, timeout_s)
                if message is None:
                    # NOTE: the client ended a single-message call's stream without its message. grpclib hands
                    # the method None, which methods do not expect (grpclib's health Check asserts): UNKNOWN
                    # and a traceback in the log per call.
                    raise GRPCError(Status.INVALID_ARGUMENT, "missing request message: the stream ended")
                return message

            # NOTE: an instance attribute shadows the method; `async for msg in stream` goes through it too.
            stream.recv_message = recv_message  # type: ignore[method-assign]
            try:
                await method_func(stream)
            finally:
                # NOTE: left on the stream, the function (which refers to it) made the call's objects a
                # reference cycle: freed only by a collection, not when the call ends (issue 37, item 4)
                del stream.recv_message

        return bounded_method


def install_message_size_limit(
    server: Server, max_receive_message_size: int, *, receive_timeout_s: float | None = None
) -> MessageSizeLimit:
    listener = MessageSizeLimit(max_receive_message_size, receive_timeout_s=receive_timeout_s)
    listen(server, RecvRequest, listener)
    return listener
