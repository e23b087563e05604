"""GuardedServer: grpclib's Server with the HTTP/2 guard on every connection and TLS certificate reload."""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable, Collection
from ssl import SSLContext
from typing import Any

from grpclib._typing import IServable
from grpclib.protocol import H2Protocol
from grpclib.server import Handler, Server

from engine_server.api.rate_limited_log import RateLimitedLog
from engine_server.api.security.budget import GuardStats
from engine_server.api.security.config import H2Policy
from engine_server.api.security.tls import CertificateWatcher
from engine_server.api.transport.h2_guard import GuardedH2Protocol

# (mapping, codec, status_details_codec, dispatch, *, stats, log_limit) -> the Handler of one connection
HandlerFactory = Callable[..., Handler]


def _grpclib_handler(*args: Any, stats: GuardStats, log_limit: RateLimitedLog) -> Handler:
    return Handler(*args)


class GuardedServer(Server):
    """grpclib's Server whose connections are GuardedH2Protocols; `guard_stats` counts what they did.

    With `cert_reload` (cert_file, key_file, interval_s) and a TLS context passed to `start`, a rotated
    certificate is reloaded into that context while the server runs. `begin_drain` sends every connection
    GOAWAY(NO_ERROR) as soon as it has no stream open (h2_guard, 6); `close` begins it too. `log_limit`
    rate-limits the log lines its clients can cause at will (GOAWAYs for abuse, rejected API keys, cancelled
    calls), for all its connections.
    """

    def __init__(
        self,
        handlers: Collection[IServable],
        *,
        policy: H2Policy | None = None,
        cert_reload: tuple[str, str, float] | None = None,
        handler_factory: HandlerFactory | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(handlers, **kwargs)
        self._handler_factory = handler_factory or _grpclib_handler
        self.policy = policy if policy is not None else H2Policy()
        self.guard_stats = GuardStats()
        self.log_limit = RateLimitedLog()
        self._cert_reload = cert_reload
        self._cert_watch: asyncio.Task[None] | None = None
        self._is_draining = False
        # NOTE: weak: a closed connection's protocol goes away with its transport, nothing to unregister.
        self._protocols: weakref.WeakSet[GuardedH2Protocol] = weakref.WeakSet()
        self._lost_handlers: set[asyncio.Task[None]] = set()  # of lost connections, until their calls end

    async def start(self, *args: Any, ssl: SSLContext | None = None, **kwargs: Any) -> None:
        await super().start(*args, ssl=ssl, **kwargs)
        if ssl is not None and self._cert_reload is not None:
            cert_file, key_file, interval_s = self._cert_reload
            watcher = CertificateWatcher(ssl, cert_file=cert_file, key_file=key_file)
            self._cert_watch = asyncio.get_running_loop().create_task(
                watcher.run(interval_s=interval_s), name="tls-certificate-watcher"
            )

    def begin_drain(self) -> None:
        """Idle connections get GOAWAY and close now, busy ones once their last stream has ended."""
        self._is_draining = True
        for protocol in list(self._protocols):
            protocol.begin_drain()

    def close(self) -> None:
        if self._cert_watch is not None:
            self._cert_watch.cancel()
            self._cert_watch = None
        # Before the handlers are cancelled: each connection then gets its GOAWAY as its cancelled
        # handlers release their streams (grpclib's close alone leaves the connections open).
        self.begin_drain()
        super().close()
        self.log_limit.flush()

    def _protocol_factory(self) -> H2Protocol:
        # As grpclib's Server does, with our handler (fast path) and protocol (the guard).
        self.__gc_step__()
        handler = self._handler_factory(
            self._mapping, self._codec, self._status_details_codec, self.__dispatch__, stats=self.guard_stats,
            log_limit=self.log_limit,
        )
        self._handlers.add(handler)
        protocol = GuardedH2Protocol(
            handler, self._config, self._h2_config, policy=self.policy, stats=self.guard_stats,
            log_limit=self.log_limit, is_draining=self._is_draining,
            on_lost=functools.partial(self._connection_lost, handler),
        )
        self._protocols.add(protocol)
        return protocol

    def _connection_lost(self, handler: Handler) -> None:
        """A connection is gone: its handler leaves the server once its calls have ended.

        NOTE: grpclib drops closed handlers only when every 10th connection is accepted: until then each kept
        what its connection held (its last finished calls and their streams, h2's books), up to ~0.5 MB, and
        a soak that reconnected now and then saw it as a leak (issue 37, item 4).
        """
        if handler.check_closed():
            self._handlers.discard(handler)
            return
        # (a connection lost with calls in flight: grpclib cancelled them; they end soon)
        ended = asyncio.get_running_loop().create_task(handler.wait_closed())
        self._lost_handlers.add(ended)
        ended.add_done_callback(lambda _: self._forget(ended, handler))

    def _forget(self, ended: asyncio.Task[None], handler: Handler) -> None:
        self._lost_handlers.discard(ended)
        self._handlers.discard(handler)
