"""Security and protection layer of the gRPC server: TLS/mTLS, API key, message size, HTTP/2 abuse limits.

Interface (what the server assembly calls; everything is keyword-only after the first argument):

    from engine_server.api.security import SecurityConfig, H2Policy, build_server

    config = SecurityConfig(
        tls_cert_file=..., tls_key_file=..., tls_client_ca_file=None,   # str paths or None
        tls_reload_interval_s=60.0,            # the started server reloads a rotated cert/key pair
        api_key=None,                          # str or None (no auth); see auth.resolve_api_key()
        auth_exempt_services=AUTH_EXEMPT_SERVICES,  # health and reflection answer without the key
        max_receive_message_size=4 << 20,      # bytes
        request_receive_timeout_s=60.0,        # single-message calls must send it within this time
        keepalive_time_s=60.0, keepalive_timeout_s=20.0,
        h2=H2Policy(max_concurrent_streams=512, ...),
    )                                          # raises ValueError with a one-line message on bad input
    server = build_server(handlers, config)    # a grpclib Server subclass (guarded_server.GuardedServer)
                                               # with the API key, message limits and h2 guard installed
    await server.start(host, port, ssl=config.server_ssl_context())  # None when TLS is off
    server.guard_stats                         # budget.GuardStats: GOAWAYs by reason, refused streams
    metrics.register_guard_metrics(registry, server.guard_stats)   # engine_http2_* Prometheus counters

Building blocks (usable on their own):
    tls.build_server_ssl_context(*, cert_file, key_file, client_ca_file=None) -> ssl.SSLContext
        TLS >= 1.2, ALPN "h2"; with client_ca_file, client certificates are REQUIRED and verified.
    tls.build_client_ssl_context(*, ca_file, cert_file=None, key_file=None) -> ssl.SSLContext  (tests, SDKs)
    tls.CertificateWatcher(ctx, *, cert_file, key_file): .check() -> bool, `await .run(interval_s=60.0)`
        Reloads a rotated certificate/key pair into the live context (new handshakes); a pair that does not
        load is skipped and retried. build_server's GuardedServer runs one when started with TLS.
    auth.install_api_key_check(server, api_key, *, exempt_services=AUTH_EXEMPT_SERVICES, log_limit=None)
        Every call must carry `authorization: Bearer <key>` or `x-api-key: <key>`, compared in constant time;
        otherwise UNAUTHENTICATED (logged at INFO, one line per 10 s and a count). api_key=None installs
        nothing.
    auth.resolve_api_key(*, api_key=None, api_key_file=None, environ=os.environ) -> str | None
        Flag, then file (trailing newline stripped), then $ENGINE_API_KEY.
    limits.install_message_size_limit(server, max_size, *, receive_timeout_s=None) -> MessageSizeLimit
        A request message whose length prefix exceeds the limit -> RESOURCE_EXHAUSTED before its body is
        buffered; the connection and the server keep serving. A single-message call that does not deliver
        it within receive_timeout_s -> DEADLINE_EXCEEDED.
    guarded_server.GuardedServer(handlers, *, policy=H2Policy(), cert_reload=None, **grpclib Server kwargs)
        PING flood / rapid reset / control-frame floods -> GOAWAY(ENHANCE_YOUR_CALM) + close; idle connections
        -> GOAWAY(NO_ERROR) + close; a stream past SETTINGS_MAX_CONCURRENT_STREAMS -> RST_STREAM(
        REFUSED_STREAM) alone; see h2_guard.py. `.log_limit`: the rate limit of the log lines its clients can
        cause (rate_limited_log.py). `.begin_drain()` (and `.close()`): each connection gets
        GOAWAY(NO_ERROR, "drain") + close once no stream is open (goaway.py: early GOAWAY, linger).
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any

from engine_server.api.security.auth import install_api_key_check, resolve_api_key
from engine_server.api.security.budget import GuardStats
from engine_server.api.security.config import (
    AUTH_EXEMPT_SERVICES,
    HEALTH_SERVICE,
    REFLECTION_SERVICES,
    H2Policy,
    SecurityConfig,
)
from engine_server.api.transport import IServable
from engine_server.api.transport.guarded_server import GuardedServer
from engine_server.api.transport.limits import install_message_size_limit

__all__ = [
    "AUTH_EXEMPT_SERVICES",
    "HEALTH_SERVICE",
    "REFLECTION_SERVICES",
    "GuardStats",
    "GuardedServer",
    "H2Policy",
    "SecurityConfig",
    "build_server",
    "resolve_api_key",
]


def build_server(
    handlers: Collection[IServable], config: SecurityConfig, **server_kwargs: Any
) -> GuardedServer:
    """A grpclib server for `handlers` with every protection of `config` installed.

    `server_kwargs` go to GuardedServer (handler_factory) and grpclib's Server (codec, status_details_codec);
    call it inside the event loop. The default handler is the fast path's with no fast method: grpclib's
    request_handler for every call, except calls with a deadline or binary metadata, which it mishandles
    (fast_path.FastPathHandler._call_to_serve).
    The API-key check is installed first: RecvRequest listeners the caller adds afterwards (metrics) see
    unauthenticated calls with their UNAUTHENTICATED status, but no servicer runs for them.
    """
    if "handler_factory" not in server_kwargs:
        # NOTE: imported here: fast_path imports modules of this package
        from engine_server.api.transport.fast_path import FastPathHandler

        server_kwargs["handler_factory"] = functools.partial(FastPathHandler, fast_methods=())
    cert_reload = None
    if config.tls_cert_file and config.tls_key_file and config.tls_reload_interval_s is not None:
        cert_reload = (config.tls_cert_file, config.tls_key_file, config.tls_reload_interval_s)
    server = GuardedServer(
        handlers,
        policy=config.h2,
        cert_reload=cert_reload,
        config=config.grpclib_configuration(),
        **server_kwargs,
    )
    install_api_key_check(
        server, config.api_key, exempt_services=config.auth_exempt_services, log_limit=server.log_limit
    )
    install_message_size_limit(
        server, config.max_receive_message_size, receive_timeout_s=config.request_receive_timeout_s
    )
    return server
