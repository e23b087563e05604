"""SecurityConfig: every knob of the security layer, validated once, filled in by the CLI."""

from __future__ import annotations

import math
import os
import ssl
from dataclasses import dataclass, field

from grpclib.config import Configuration

from engine_server.api.security.tls import build_server_ssl_context

HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICES = ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection")
# Callable without the API key: probes (load balancers, Kubernetes, grpc-health-probe) must reach health, and
# reflection serves only the service descriptors (the public contract), so `grpcurl list/describe` work.
AUTH_EXEMPT_SERVICES = (HEALTH_SERVICE, *REFLECTION_SERVICES)

_MiB = 1 << 20
# NOTE: the gRPC length prefix is a uint32, and grpc-core caps it at INT32_MAX.
_MAX_MESSAGE_LIMIT = (1 << 31) - 1


def _check_positive(name: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True, slots=True)
class H2Policy:
    """Per-connection HTTP/2 abuse limits (see h2_guard.py for how each one is enforced).

    A connection that breaks one of them gets GOAWAY(ENHANCE_YOUR_CALM) and is closed; other connections
    are unaffected.
    """

    # Advertised in SETTINGS_MAX_CONCURRENT_STREAMS. Streams whose handlers are still unwinding after a
    # client reset also count (as in Go's CVE-2023-44487 fix), up to 2x this, then new streams are refused.
    max_concurrent_streams: int = 512
    # A PING is a "strike" when it arrives less than min_ping_interval_s after the previous PING and the
    # server has sent no DATA/HEADERS since then (grpc-core / grpc-go policy); more than max_ping_strikes
    # strikes -> GOAWAY "too_many_pings". Keepalive pings every >= 5 s never strike.
    max_ping_strikes: int = 2
    min_ping_interval_s: float = 5.0
    # Client RST_STREAMs: a token bucket (burst, refill per second). Rapid reset sends thousands a second.
    reset_burst: int = 1000
    reset_rate_per_s: float = 200.0
    # SETTINGS / PRIORITY frames and unsolicited WINDOW_UPDATEs (those not paid for by DATA we sent).
    control_frame_burst: int = 1000
    control_frame_rate_per_s: float = 100.0
    # A connection without calls for this long gets GOAWAY(NO_ERROR) and is closed: bounds sockets held by
    # clients that connect and never call (or never even finish the HTTP/2 preface). None: never.
    max_connection_idle_s: float | None = 300.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_concurrent_streams <= (1 << 31) - 1:
            raise ValueError(
                f"max_concurrent_streams must be in [1, 2^31-1], got {self.max_concurrent_streams}"
            )
        if self.max_ping_strikes < 0:
            raise ValueError(f"max_ping_strikes must be >= 0, got {self.max_ping_strikes}")
        _check_positive("min_ping_interval_s", self.min_ping_interval_s)
        if self.reset_burst < 1:
            raise ValueError(f"reset_burst must be >= 1, got {self.reset_burst}")
        _check_positive("reset_rate_per_s", self.reset_rate_per_s)
        if self.control_frame_burst < 1:
            raise ValueError(f"control_frame_burst must be >= 1, got {self.control_frame_burst}")
        _check_positive("control_frame_rate_per_s", self.control_frame_rate_per_s)
        if self.max_connection_idle_s is not None:
            _check_positive("max_connection_idle_s", self.max_connection_idle_s)


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """TLS, API key, message size, keepalive and HTTP/2 limits of one server.

    Paths are checked for existence here (a one-line error at startup); PEM contents are checked by
    `server_ssl_context()`.
    """

    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # Set: mutual TLS; clients must present a certificate signed by this CA.
    tls_client_ca_file: str | None = None
    # How often the running server looks for a rotated certificate/key pair (tls.CertificateWatcher).
    tls_reload_interval_s: float | None = 60.0
    # None: no authentication. NOTE: repr=False keeps the key out of logs and tracebacks.
    api_key: str | None = field(default=None, repr=False)
    # Services callable without the key (full names).
    auth_exempt_services: tuple[str, ...] = AUTH_EXEMPT_SERVICES
    max_receive_message_size: int = 4 * _MiB
    # A call with a single request message (every engine.v1 RPC) must deliver it within this time after its
    # headers, else DEADLINE_EXCEEDED: a client cannot park handlers by opening calls and never sending.
    request_receive_timeout_s: float | None = 60.0
    # The server PINGs each connection with calls in flight this often (grpclib: a fixed timer, traffic or
    # not); no PING ACK within keepalive_timeout_s closes it and cancels its calls. None: never ping.
    keepalive_time_s: float | None = 60.0
    keepalive_timeout_s: float = 20.0
    h2: H2Policy = H2Policy()

    def __post_init__(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mTLS) needs tls_cert_file and tls_key_file")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file: {path}")
        if self.tls_reload_interval_s is not None:
            _check_positive("tls_reload_interval_s", self.tls_reload_interval_s)
        if self.api_key is not None:
            validate_api_key(self.api_key)
        for service in self.auth_exempt_services:
            if not service or "/" in service:
                raise ValueError(f"auth_exempt_services: expected a full service name, got {service!r}")
        if not 1 <= self.max_receive_message_size <= _MAX_MESSAGE_LIMIT:
            raise ValueError(
                f"max_receive_message_size must be in [1, {_MAX_MESSAGE_LIMIT}], "
                f"got {self.max_receive_message_size}"
            )
        if self.request_receive_timeout_s is not None:
            _check_positive("request_receive_timeout_s", self.request_receive_timeout_s)
        if self.keepalive_time_s is not None:
            _check_positive("keepalive_time_s", self.keepalive_time_s)
        _check_positive("keepalive_timeout_s", self.keepalive_timeout_s)

    @property
    def is_tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def is_mtls(self) -> bool:
        return self.tls_client_ca_file is not None

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """The listener's TLS context, or None for plaintext; bad PEM files raise ValueError."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return build_server_ssl_context(
            cert_file=self.tls_cert_file, key_file=self.tls_key_file, client_ca_file=self.tls_client_ca_file
        )

    def grpclib_configuration(self) -> Configuration:
        """grpclib's own knobs: server keepalive pings (grpclib sends them only while calls are open)."""
        if self.keepalive_time_s is None:
            return Configuration(_keepalive_time=None)
        return Configuration(
            _keepalive_time=self.keepalive_time_s,
            _keepalive_timeout=self.keepalive_timeout_s,
            # grpclib's defaults (2 pings, then 300 s between pings without data) would stretch our interval.
            _http2_max_pings_without_data=0,
            _http2_min_sent_ping_interval_without_data=self.keepalive_time_s,
        )


def validate_api_key(api_key: str) -> None:
    # The key travels in a header: printable ASCII without spaces, and long enough to not be guessable.
    if not api_key:
        raise ValueError("api_key must not be empty")
    if any(not (0x21 <= ord(ch) <= 0x7E) for ch in api_key):
        raise ValueError("api_key must be printable ASCII without whitespace")
