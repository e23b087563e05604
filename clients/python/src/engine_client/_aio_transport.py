"""grpclib specifics: channel construction, size-limited codec, checked response reads, error translation."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from google.protobuf.message import DecodeError
from grpclib.client import Channel, Handler, Stream
from grpclib.config import Configuration
from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from grpclib.protocol import H2Protocol

from .errors import EngineError, StatusCode, error_from_status
from .options import ConnectionOptions

if TYPE_CHECKING:
    from grpclib._typing import IProtoMessage

# What a grpclib call can raise besides CancelledError; everything else is a bug and propagates as it is.
TRANSPORT_ERRORS = (GRPCError, StreamTerminatedError, ProtocolError, OSError, asyncio.TimeoutError)

# What grpclib's client raises, unchecked, for a response it cannot read: headers without :status (KeyError),
# "-bin" metadata or status details that are not base64 (binascii.Error, a ValueError), status details or a
# message that do not parse (DecodeError), a message that claims compression (NotImplementedError), a stream
# that ends inside a message (AssertionError) or inside its 5-byte prefix (struct.error).
_MALFORMED_RESPONSE = (KeyError, ValueError, DecodeError, NotImplementedError, AssertionError, struct.error)


class _CheckedStream(Stream[Any, Any]):
    """grpclib's client call whose every read of the server's response fails with INTERNAL (as grpcio and
    grpc-go report a malformed response) instead of one of the errors above, which no caller expects."""

    async def recv_initial_metadata(self) -> None:
        with _malformed_is_internal():
            await super().recv_initial_metadata()

    async def recv_message(self) -> Any:
        with _malformed_is_internal():
            return await super().recv_message()

    async def recv_trailing_metadata(self) -> None:
        with _malformed_is_internal():
            await super().recv_trailing_metadata()

    def _maybe_raise(self) -> None:  # (the status of a call whose stream was reset or whose connection died)
        with _malformed_is_internal():
            super()._maybe_raise()


@contextlib.contextmanager
def _malformed_is_internal() -> Iterator[None]:
    try:
        yield
    except _MALFORMED_RESPONSE as exc:
        raise GRPCError(Status.INTERNAL, f"malformed response from the server: {exc!r}") from None


class _CheckedProtocol(H2Protocol):
    def data_received(self, data: bytes) -> None:
        try:
            super().data_received(data)
        except UnicodeDecodeError:
            # NOTE: h2 decodes header bytes as ASCII (grpclib's setting) and lets one outside it escape: the
            # transport died with asyncio's "Fatal error" in the log. As grpclib treats h2's ProtocolError:
            self.processor.close("Protocol error: a header field is not ASCII")


class _CheckedChannel(Channel):
    def request(self, *args: Any, **kwargs: Any) -> Stream[Any, Any]:
        call = super().request(*args, **kwargs)
        call.__class__ = _CheckedStream  # NOTE: grpclib builds its Stream inline; the subclass adds no state
        return call

    def _protocol_factory(self) -> H2Protocol:  # (as grpclib's, with the protocol above)
        return _CheckedProtocol(Handler(), self._config, self._h2_config)


class LimitedProtoCodec(ProtoCodec):
    """ProtoCodec with message-size limits (grpclib's client has none; grpcio's does)."""

    def __init__(self, *, max_send: int, max_receive: int) -> None:
        self._max_send = max_send
        self._max_receive = max_receive

    def encode(self, message: IProtoMessage, message_type: type[IProtoMessage]) -> bytes:
        data = super().encode(message, message_type)
        if len(data) > self._max_send:
            raise GRPCError(Status.RESOURCE_EXHAUSTED,
                            f"request of {len(data)} bytes exceeds max_send_message_bytes={self._max_send}")
        return data

    def decode(self, data: bytes, message_type: type[IProtoMessage]) -> IProtoMessage:
        if len(data) > self._max_receive:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, f"response of {len(data)} bytes exceeds "
                            f"max_receive_message_bytes={self._max_receive}")
        return super().decode(data, message_type)


def ssl_context(options: ConnectionOptions) -> ssl.SSLContext | None:
    tls = options.tls
    if tls is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                     cafile=None if tls.ca_file is None else str(tls.ca_file))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert_file is not None and tls.key_file is not None:
        ctx.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    ctx.set_alpn_protocols(["h2"])
    return ctx


def open_channel(options: ConnectionOptions) -> Channel:
    """A grpclib Channel for the options (must be called with an event loop running)."""
    config = Configuration(
        _keepalive_time=options.keepalive_time,
        _keepalive_timeout=options.keepalive_timeout,
        ssl_target_name_override=options.tls.server_name if options.tls is not None else None,
    )
    codec = LimitedProtoCodec(max_send=options.max_send_message_bytes,
                              max_receive=options.max_receive_message_bytes)
    address = options.address()
    ssl_ctx = ssl_context(options)
    if isinstance(address, str):
        return _CheckedChannel(path=address, ssl=ssl_ctx, config=config, codec=codec)
    host, port = address
    return _CheckedChannel(host, port, ssl=ssl_ctx, config=config, codec=codec)


def translate(exc: BaseException, *, request_id: str | None = None) -> EngineError:
    """THE place a grpclib-side failure becomes an EngineError."""
    if isinstance(exc, GRPCError):
        return error_from_status(exc.status.value, exc.message, request_id=request_id)
    # NOTE: asyncio.TimeoutError is an OSError subclass since 3.11: test it first.
    if isinstance(exc, asyncio.TimeoutError):
        return error_from_status(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", request_id=request_id)
    if isinstance(exc, StreamTerminatedError | OSError):
        return error_from_status(StatusCode.UNAVAILABLE, f"connection failed: {exc}", request_id=request_id)
    return error_from_status(StatusCode.INTERNAL, f"protocol error: {exc}", request_id=request_id)
