"""grpcio specifics: channel construction and exception translation."""

from __future__ import annotations

import grpc

from .errors import EngineError, StatusCode, error_from_status
from .options import ConnectionOptions


def open_channel(options: ConnectionOptions) -> grpc.Channel:
    """A grpcio Channel for the options (connects lazily, on the first call)."""
    channel_options: list[tuple[str, str | int]] = [
        ("grpc.max_send_message_length", options.max_send_message_bytes),
        ("grpc.max_receive_message_length", options.max_receive_message_bytes),
        # NOTE: the client does its own, safer retries (never re-running a Generate that streamed output).
        ("grpc.enable_retries", 0),
    ]
    if options.keepalive_time is not None:
        channel_options += [
            ("grpc.keepalive_time_ms", int(options.keepalive_time * 1000)),
            ("grpc.keepalive_timeout_ms", int(options.keepalive_timeout * 1000)),
            ("grpc.http2.max_pings_without_data", 0),
        ]
    target = options.target
    if options.tls is None:
        return grpc.insecure_channel(target, options=channel_options)
    ca, chain, key = options.tls.read_files()
    if options.tls.server_name is not None:
        channel_options.append(("grpc.ssl_target_name_override", options.tls.server_name))
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)
    return grpc.secure_channel(target, credentials, options=channel_options)


def translate(exc: grpc.RpcError, *, request_id: str | None = None) -> EngineError:
    """THE place a grpcio failure becomes an EngineError."""
    # NOTE: the RpcError grpcio raises is also a grpc.Call (code(), details()); the stubs cannot express that.
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        return error_from_status(StatusCode.UNKNOWN, str(exc), request_id=request_id)
    status: int = code.value[0]
    return error_from_status(status, details if isinstance(details, str) else None, request_id=request_id)
