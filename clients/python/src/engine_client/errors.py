"""The exception hierarchy of engine-client, mapped from gRPC status codes in one place for both transports.

Example::

    try:
        result = client.complete("Hello", max_tokens=8)
    except OverloadedError:
        ...  # RESOURCE_EXHAUSTED: back off and retry later
    except EngineError as exc:
        print(exc.code.name, exc.message, exc.request_id)
"""

from __future__ import annotations

import enum

__all__ = [
    "AuthenticationError",
    "DeadlineExceededError",
    "EngineError",
    "InternalError",
    "InvalidRequestError",
    "NotFoundError",
    "OverloadedError",
    "PermissionDeniedError",
    "RequestCancelledError",
    "StatusCode",
    "UnavailableError",
    "UnimplementedError",
    "error_from_status",
]


class StatusCode(enum.IntEnum):
    """The gRPC status codes (same numbers on every transport)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class EngineError(Exception):
    """Base of every error a call to the server raises.

    Attributes: ``code`` (a :class:`StatusCode`), ``message`` (the server's message), ``request_id`` (the
    Generate request's id, when the call was a Generate; else None).

    Example: ``except EngineError as exc: log.warning("%s %s", exc.code.name, exc.message)``
    """

    code: StatusCode
    message: str
    request_id: str | None

    def __init__(self, code: StatusCode, message: str, *, request_id: str | None = None) -> None:
        self.code = code
        self.message = message
        self.request_id = request_id
        suffix = f" (request_id={request_id})" if request_id else ""
        super().__init__(f"{code.name}: {message}{suffix}")

    def __reduce__(self) -> tuple[object, ...]:
        # NOTE: keyword-only __init__ args need an explicit reduce for pickling (multiprocessing users).
        return (_rebuild, (type(self), int(self.code), self.message, self.request_id))


def _rebuild(cls: type[EngineError], code: int, message: str, request_id: str | None) -> EngineError:
    return cls(StatusCode(code), message, request_id=request_id)


class InvalidRequestError(EngineError):
    """INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION: the request is wrong; do not retry it as it is."""


class NotFoundError(EngineError):
    """NOT_FOUND: the named thing (for example a health service name) does not exist."""


class OverloadedError(EngineError):
    """RESOURCE_EXHAUSTED: too many requests, or a message over a size limit. Retry later."""


class UnavailableError(EngineError):
    """UNAVAILABLE: the server is unreachable, starting, draining or its engine failed. Safe to retry."""


class DeadlineExceededError(EngineError):
    """DEADLINE_EXCEEDED: the call's deadline passed; the server aborted the request."""


class AuthenticationError(EngineError):
    """UNAUTHENTICATED: no API key or a wrong one."""


class PermissionDeniedError(AuthenticationError):
    """PERMISSION_DENIED: authenticated, but not allowed."""


class UnimplementedError(EngineError):
    """UNIMPLEMENTED: the server does not serve this RPC."""


class RequestCancelledError(EngineError):
    """CANCELLED: the call was cancelled (by the server, or by a transport reset)."""


class InternalError(EngineError):
    """INTERNAL, UNKNOWN, DATA_LOSS or any other code: a server fault; details are in the server log."""


def _build_table() -> dict[StatusCode, type[EngineError]]:
    return {
        StatusCode.INVALID_ARGUMENT: InvalidRequestError,
        StatusCode.OUT_OF_RANGE: InvalidRequestError,
        StatusCode.FAILED_PRECONDITION: InvalidRequestError,
        StatusCode.ALREADY_EXISTS: InvalidRequestError,
        StatusCode.NOT_FOUND: NotFoundError,
        StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
        StatusCode.UNAVAILABLE: UnavailableError,
        StatusCode.ABORTED: UnavailableError,
        StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
        StatusCode.UNAUTHENTICATED: AuthenticationError,
        StatusCode.PERMISSION_DENIED: PermissionDeniedError,
        StatusCode.UNIMPLEMENTED: UnimplementedError,
        StatusCode.CANCELLED: RequestCancelledError,
    }


# NOTE: an immutable mapping built once; never mutated (no module-level mutable state).
_ERROR_CLASSES = _build_table()


def error_from_status(code: int, message: str | None, *, request_id: str | None = None) -> EngineError:
    """Return the exception for a gRPC status code: THE mapping both transports use."""
    try:
        status = StatusCode(code)
    except ValueError:
        status = StatusCode.UNKNOWN
    cls = _ERROR_CLASSES.get(status, InternalError)
    return cls(status, message or status.name.lower().replace("_", " "), request_id=request_id)
