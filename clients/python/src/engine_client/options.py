"""Connection options shared by both clients: target, TLS, API key, deadlines, keepalive, limits, retries.

Example::

    options = ConnectionOptions(
        "engine.internal:443",
        tls=TLSConfig(ca_file="ca.pem", cert_file="client.pem", key_file="client.key"),  # mTLS
        api_key=os.environ["ENGINE_API_KEY"],
        timeout=30.0,
    )
    with EngineClient(options) as client:
        print(client.model_info().served_model_name)
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["DEFAULT_TARGET", "ConnectionOptions", "RetryPolicy", "TLSConfig"]

DEFAULT_TARGET = "127.0.0.1:50051"
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """TLS for the connection. No CA file = the system's trust store; cert+key = mTLS client identity.

    ``server_name`` overrides the name the server's certificate is checked against (default: the target host).

    Example: ``EngineClient("10.0.0.5:443", tls=TLSConfig(ca_file="ca.pem", server_name="engine.lan"))``
    """

    ca_file: str | os.PathLike[str] | None = None
    cert_file: str | os.PathLike[str] | None = None
    key_file: str | os.PathLike[str] | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (mTLS needs both)")

    def read_files(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(CA, client cert chain, client key) as PEM bytes, as grpcio wants them."""

        def read(path: str | os.PathLike[str] | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return read(self.ca_file), read(self.cert_file), read(self.key_file)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries with exponential backoff and jitter for UNAVAILABLE, on calls that are safe to repeat.

    Unary calls are retried; a Generate is retried only when no response was received yet (it never silently
    re-runs a request that already streamed tokens). ``max_attempts=1`` disables retries.

    Example: ``ConnectionOptions("host:50051", retry=RetryPolicy(max_attempts=5, initial_backoff=0.2))``
    """

    max_attempts: int = 3
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2  # fraction of each delay, drawn uniformly from [-jitter, +jitter]

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not (self.initial_backoff >= 0 and self.max_backoff >= self.initial_backoff):
            raise ValueError("need 0 <= initial_backoff <= max_backoff")
        if self.multiplier < 1:
            raise ValueError("multiplier must be >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be in [0, 1]")

    def delays(self) -> Iterator[float]:
        """The sleep before attempt 2, 3, ... (max_attempts - 1 values)."""
        delay = self.initial_backoff
        for _ in range(self.max_attempts - 1):
            yield max(0.0, delay * (1 + random.uniform(-self.jitter, self.jitter)))
            delay = min(self.max_backoff, delay * self.multiplier)


@dataclass(frozen=True, slots=True)
class ConnectionOptions:
    """Where and how to connect. ``target`` is ``host:port``, ``[v6]:port`` or ``unix:/path``.

    ``timeout`` is the default per-call deadline in seconds (None = no deadline; a Generate stream counts as
    one call). Every method also takes ``timeout=`` to override it per call.

    Example: ``AsyncEngineClient(ConnectionOptions("unix:/run/engine.sock", api_key="k", timeout=10.0))``
    """

    target: str = DEFAULT_TARGET
    tls: TLSConfig | None = None
    api_key: str | None = field(default=None, repr=False)
    # The server's adapter admin key, sent (as x-admin-key) on the adapter admin calls only.
    admin_key: str | None = field(default=None, repr=False)
    timeout: float | None = None
    # Seconds between HTTP/2 PINGs on an idle connection; None = off. NOTE: off by default because servers
    # with a ping policy (grpc-core's default minimum is 5 minutes) close connections that ping more often.
    keepalive_time: float | None = None
    keepalive_timeout: float = 20.0  # seconds to wait for the PING's answer before closing the connection
    max_send_message_bytes: int = 16 * _MIB
    max_receive_message_bytes: int = 64 * _MIB
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        self.address()  # validates the target
        if self.timeout is not None and not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError("timeout must be a positive number of seconds or None")
        if self.keepalive_time is not None and self.keepalive_time <= 0:
            raise ValueError("keepalive_time must be > 0 or None")
        if self.keepalive_timeout <= 0:
            raise ValueError("keepalive_timeout must be > 0")
        if self.max_send_message_bytes <= 0 or self.max_receive_message_bytes <= 0:
            raise ValueError("message size limits must be > 0")
        if self.api_key is not None and (not self.api_key or any(c in self.api_key for c in "\r\n")):
            raise ValueError("api_key must be a non-empty single-line string")
        if self.admin_key is not None and (not self.admin_key or any(c in self.admin_key for c in "\r\n")):
            raise ValueError("admin_key must be a non-empty single-line string")

    def address(self) -> tuple[str, int] | str:
        """(host, port), or the socket path of a ``unix:`` target."""
        target = self.target
        if target.startswith("unix:"):
            path = target[len("unix:"):].removeprefix("//")
            if not path:
                raise ValueError(f"bad target {target!r}: empty unix socket path")
            return path
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"bad target {target!r}: expected host:port, [v6]:port or unix:/path")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        port_number = int(port)
        if not 0 < port_number < 65536:
            raise ValueError(f"bad target {target!r}: port out of range")
        return host, port_number

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata sent on every call (the API key as ``authorization: Bearer <key>``)."""
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def admin_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata of the adapter admin calls: every call's, and the admin key as ``x-admin-key``."""
        return self.metadata() + ((("x-admin-key", self.admin_key),) if self.admin_key else ())

    def deadline(self, timeout: float | None) -> float | None:
        """The monotonic deadline of a call: a per-call timeout overrides the default one."""
        seconds = self.timeout if timeout is None else timeout
        if seconds is None:
            return None
        if not seconds > 0:
            raise ValueError("timeout must be > 0")
        return time.monotonic() + seconds


def remaining(deadline: float | None) -> float | None:
    """Seconds left until a deadline (never negative); None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def fits(deadline: float | None, delay: float) -> bool:
    """Whether sleeping ``delay`` seconds still leaves time before the deadline for another attempt."""
    return deadline is None or deadline - time.monotonic() > delay


def with_overrides(
    target: str | ConnectionOptions, *, api_key: str | None, tls: TLSConfig | None, timeout: float | None
) -> ConnectionOptions:
    """The options a client was constructed with: a target string plus keywords, or a ConnectionOptions."""
    if isinstance(target, ConnectionOptions):
        if api_key is not None or tls is not None or timeout is not None:
            raise ValueError("pass api_key/tls/timeout inside the ConnectionOptions, not beside it")
        return target
    return ConnectionOptions(target, api_key=api_key, tls=tls, timeout=timeout)
